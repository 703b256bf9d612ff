"""How long a stage takes: the time model ``ktflow plan`` and ``sft.backend: auto`` share.

Its constants are fitted on the runs kept in docs/benchmarks (``calibration.json`` lists every
one with the files each figure came from): one host kind, an H100 80GB with a 16-core AMX Xeon
(one NUMA node). Thread counts scale KT's CPU rate proportionally, an assumption no run checked.
"""

from __future__ import annotations

from pydantic import BaseModel

from ktflow.planning.sizing import ModelSize, kt_share_backward_bb
from ktflow.recipe import SftConfig
from ktflow.units import GB


class CostModel(BaseModel):
    """Constants of the time model, each fitted on measured runs (docs/benchmarks/calibration.json).

    KT SFT's step streams every MoE layer's routed experts through the CPU kernels once per pass
    (forward, the recompute under gradient checkpointing, and backward at twice a forward's cost),
    so its time follows expert parameters per micro-batch, not FLOPs, at these batch sizes.
    """

    # Expert parameters per second per pass and per KT thread: 26.7e9 on 16 threads (the V2-Lite
    # profile); the 57B RAWINT4 run, not used for the fit, implies 27.6e9.
    kt_expert_params_per_thread_s: float = 26.7e9 / 16
    kt_forward_call_s: float = 0.0187  # KT's fixed cost per MoE layer and micro-batch, forward (tiny profile)
    kt_backward_call_s: float = 0.0356  # and backward
    kt_repack_wait_s_per_param: float = 5.44e-11  # blocking backward repack with shared buffers (V2-Lite profile)
    # GPU and framework time per micro-batch: with FSDP offload it moves the non-expert weights
    # (0.331 s + 0.55 s per GB of them); without, GPU matmuls at the HF backend's measured rate.
    kt_gpu_offload_base_s: float = 0.331
    kt_gpu_offload_s_per_gb: float = 0.55
    kt_gpu_base_s: float = 0.14
    # Plain LoRA SFT (transformers 5's MoE path is launch-bound): 0.179 s per micro-batch plus
    # 6 x active parameters x tokens (4 x without gradient checkpointing) at 18.5 TFLOP/s.
    hf_micro_batch_s: float = 0.179
    hf_flops_per_s: float = 18.5e12
    kt_matmul_flops_per_s: float = 12.4e12  # the non-expert GPU work under KT (fit on the tiny GPU-host run)
    # Loading the checkpoint before the first step, and ktflow's own work around a run.
    kt_load_s: float = 36.0
    kt_load_s_per_gb: float = 0.64
    hf_load_s: float = 24.5
    hf_load_s_per_gb: float = 0.4
    prelaunch_s: float = 15.0
    publish_s: float = 2.0
    # Dequantize writes BF16 durably at ~2.5 GB/s on both hosts measured (disk-bound); quantize-int8
    # reads BF16 experts at 0.14 GB/s per core (2-core box: 1.61 GB in 5.65 s); README's figures.
    dequantize_bytes_per_s: float = 2.5e9
    quantize_bytes_per_core_s: float = 0.14e9


COSTS = CostModel()
"""The constants ktflow plans with."""




def kt_step_seconds(size: ModelSize, sft: SftConfig, threads: int, costs: CostModel = COSTS,
                    tokens_per_micro_batch: int | None = None) -> float:
    """One optimizer step of KT 0.7 LoRA SFT, in seconds."""
    micro_batches = sft.gradient_accumulation_steps
    rate = costs.kt_expert_params_per_thread_s * max(threads, 1)
    per_layer = size.expert_parameters_per_layer / rate
    recompute = not sft.disable_gradient_checkpointing and sft.kt_cpu_activation != "retain"
    forwards = 2 if recompute else 1
    layer_s = forwards * (costs.kt_forward_call_s + per_layer) + costs.kt_backward_call_s + 2 * per_layer
    tokens = tokens_per_micro_batch or sft.cutoff_len * sft.per_device_train_batch_size
    if sft.fsdp_offload_params:
        gpu_s = costs.kt_gpu_offload_base_s + costs.kt_gpu_offload_s_per_gb * 2 * size.non_expert_parameters / GB
    else:
        non_expert_matmul = size.non_expert_parameters - size.vocab_size * size.hidden_size
        gpu_s = costs.kt_gpu_base_s + 4 * non_expert_matmul * tokens / costs.kt_matmul_flops_per_s
    wait = costs.kt_repack_wait_s_per_param * size.expert_parameters if kt_share_backward_bb(sft) else 0.0
    return micro_batches * (gpu_s + size.moe_layers * layer_s + wait)


def hf_step_seconds(size: ModelSize, sft: SftConfig, costs: CostModel = COSTS,
                    tokens_per_step: int | None = None) -> float:
    """One optimizer step of plain LoRA SFT on the GPUs, in seconds."""
    micro_batches = sft.gradient_accumulation_steps
    tokens = tokens_per_step or sft.cutoff_len * sft.per_device_train_batch_size * micro_batches
    passes = 4 if sft.disable_gradient_checkpointing else 6
    flops = passes * size.active_parameters * tokens / max(sft.gpus, 1)
    return micro_batches * costs.hf_micro_batch_s + flops / costs.hf_flops_per_s
