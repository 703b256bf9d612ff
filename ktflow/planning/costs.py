"""How long a stage takes: the time model ``ktflow plan`` and ``sft.backend: auto`` share.

Its constants are fitted on the runs kept in benchmarks/data, on one host kind: an H100 80GB with a
16-core AMX Xeon (one NUMA node). KT SFT's step (:func:`kt_step_estimate`) is fitted by
``benchmarks/kt_step_model.py`` on benchmarks/data/kt-throughput (its ``fit.json`` holds the fit, the
data and every run's residual; tests check the constants here equal what the script fits); plain
SFT, loading and the other stages on benchmarks/data/calibration.json.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from ktflow.planning.sizing import ModelSize, kt_share_backward_bb
from ktflow.recipe import SftConfig
from ktflow.units import GB

# Bytes a routed-expert parameter occupies in KT's CPU RAM, by kt-kernel's expert weight format:
# packed INT4 with a BF16 scale per group of 32 (Kimi's RAWINT4: 0.5 + 2/32), FP8 with its block
# scales, INT8 and INT4 (kt-kernel's AMXINT8 and AMXINT4) with per-row scales, MXFP4 with a scale byte per 32. The
# bytes floor is reported with these.
KT_BYTES_PER_PARAM: dict[str, float] = {"rawint4": 0.5625, "mxfp4": 0.53125, "int8": 1.0, "int4": 0.5, "fp8": 1.0,
                                        "bf16": 2.0}


class CostModel(BaseModel):
    """Constants of the time model, each fitted on measured runs.

    KT SFT, per micro-batch and MoE layer, for each forward pass over the experts (two with
    ``kt_cpu_activation: recompute`` under gradient checkpointing, else one) and for the backward:
    a fixed call cost, plus a multiple of the time the host needs to read the layer's active experts
    once (their bytes / memory read bandwidth at the run's threads: the *bytes floor*), plus a
    multiple of the time its matmul units need for the tokens' expert FLOPs (tokens x top-k x
    2 x expert parameters / BF16 matmul rate at those threads: the *FLOP floor*). The GPU's part is
    a fixed cost per micro-batch plus the non-expert matmuls, and each optimizer step adds a fixed
    cost. Thread counts enter through the reference host's measured bandwidth and matmul rate at
    1-16 threads (``host.json``), not proportionally; NUMA pools (``kt_tp_enabled``) each get
    their share of the threads and their own bandwidth.
    """

    # The reference host's limits, measured on the same host as the runs (kt-throughput/host.json):
    # memory read GB/s and BF16 matmul TFLOP/s (512 x 7168 @ 7168 x 2048) by thread count, medians.
    # Between the points the rate is interpolated as a power of the threads; beyond 16 threads the
    # 8 -> 16 exponent is extended (no host with more cores was measured).
    kt_read_gb_s: dict[int, float] = {1: 11.3, 4: 40.5, 8: 59.9, 16: 101.6}
    kt_matmul_tflops: dict[int, float] = {4: 1.14, 8: 2.21, 16: 3.64}
    # Bytes per expert parameter the token-independent part is counted in, by expert format. KT's
    # kernels cost per parameter here, not per stored byte: every kt-throughput run is RAWINT4 (0.5625 B
    # stored), and calibration.json's BF16 legs (V2-Lite size) come out at +8/+8/+19 % counted at
    # RAWINT4's 0.5625 B a parameter, +47/+57/+62 % at BF16's stored 2 B (benchmarks/kt_step_model.py
    # prints both). Formats not listed count as RAWINT4 (no run measured them).
    kt_pass_bytes_per_param: dict[str, float] = {"rawint4": 0.5625, "bf16": 0.5625}
    # The per-token part relative to RAWINT4's, by expert format: RAWINT4 unpacks its weights for every
    # tile of tokens, BF16's AMX kernels read them packed. BF16's factor is fitted on calibration.json's
    # V2-Lite BF16 profile (KT's forward and backward timers); formats not listed count as RAWINT4.
    kt_flop_factor_by_format: dict[str, float] = {"rawint4": 1.0, "bf16": 0.5893}
    # Fitted by benchmarks/kt_step_model.py (benchmarks/data/kt-throughput/fit.json). Call costs are
    # kt-kernel's own wrapper time outside its NUMA compute (merges, buffer clears), per call.
    kt_forward_call_s: float = 0.008004
    kt_backward_call_s: float = 0.03729
    kt_forward_bytes_floors: float = 1.718  # forward's token-independent part, in bytes floors
    kt_backward_bytes_floors: float = 10.68
    kt_forward_flop_floors: float = 3.121  # forward's per-token part, in FLOP floors
    kt_backward_flop_floors: float = 1.359
    kt_optimizer_step_s: float = 0.393  # per optimizer step: the optimizer, logging, the loss
    kt_gpu_base_s: float = 0.2635  # per micro-batch on the GPU without FSDP offload
    kt_matmul_flops_per_s: float = 100.5e12  # the non-expert GPU matmuls under KT
    kt_repack_wait_s_per_param: float = 5.44e-11  # blocking backward repack with shared buffers (V2-Lite profile)
    # With FSDP offload the GPU part moves the non-expert weights per micro-batch: 0.331 s + 0.55 s
    # per GB of them (tiny-v3 and V2-Lite profiles, calibration.json).
    kt_gpu_offload_base_s: float = 0.331
    kt_gpu_offload_s_per_gb: float = 0.55
    # Plain LoRA SFT (transformers 5's MoE path is launch-bound): 0.179 s per micro-batch plus
    # 6 x active parameters x tokens (4 x without gradient checkpointing) at 18.5 TFLOP/s.
    hf_micro_batch_s: float = 0.179
    hf_flops_per_s: float = 18.5e12
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
    # The merge stage merging the experts' LoRA into a quantized format, bytes of the experts' BF16 a core-second:
    # fitted on one timed merge re-encoding Kimi INT4 (decode, float64 W += B @ A, the INT4 scale search, encode), the
    # Kimi-K2.5 slice at 1 MoE layer (33.8 GB of expert BF16, 118.8 s on 16 cores of an H100 host's AMX Xeon, every
    # expert with LoRA, its 15.6 GB written at dequantize's rate; benchmarks/data/merged-serving/serving/). Seven more
    # RAWINT4 merges of the slice, not used, on six H200 machines and another H100 took 0.95-1.62x the estimate
    # (median 1.08x; the 1.62x at 2 MoE layers) while the merge read the adapter's header again for every weight
    # (each read growing with the depth, the merge's time with its square); the one timed since it reads it once
    # (h200-merge-header-once/) took 0.75x, so at one MoE layer this rate now errs long (not refitted: one run). The
    # AMXINT8 and AMXINT4 merges of the same slice (one H200 machine, h200-methods/; the experts merged in kt_int8's
    # driver, which never had that cost) took 1.10x and 1.00x the estimate at this rate: the LoRA merge of each expert
    # sets the pace there too, not kt-kernel's quantizer (quantize-int8's rate above would give 15 s), so they are
    # priced with it.
    merge_expert_bytes_per_core_s: float = 18.8e6
    # KT SFT on several GPUs (sft.gpus > 1, the recipe's batch split over them): tokens/s relative to one GPU.
    # Fitted on the tiny recipes on 2 x H200 (BF16 0.61x, RAWINT4 0.65x); checked on the 57B bigger-than-GPU
    # model on 4 x H200, not used to fit: 0.66x on 2 GPUs, 0.65x on 4 (benchmarks/data/multi-gpu).
    kt_multi_gpu_speed: float = 0.63
    # Serving (sglang-kt, KT CPU experts, triton attention): one sequence's decode at concurrency 1 costs, a token, a
    # fixed time and a multiple of its *decode floor* (the routed experts one token activates, as the method stores
    # them, read once at the read bandwidth modelled for the serving threads), by serving mode: "lora" (KT's LoRA path:
    # CUDA graphs forced off, the experts' SFT kernel) and "merged" (the adapter merged into the weights, CUDA graphs
    # on; the base model served the same way). benchmarks/serve_decode_model.py fits them at ktflow serve's default
    # threads (benchmarks/data/merged-serving/decode-model.json): the Kimi-K2.5 slice at 1 and 2 MoE layers on two H200
    # + 16-core machines (14 threads); lora exactly from its two runs (10.7 and 15.3 ms), merged by least squares over
    # the merged and base runs (5.4-6.2 and 9.0-11.3 ms). Checked on merged and base runs not used (DECODE_CHECKS
    # below) on five other machines: in the 4-bit formats (RAWINT4, AMXINT4) they decoded DECODE_CHECKED_4BIT times
    # the fit's rate; at 1 MoE layer always faster than it (the fit errs slow there), at 2 within DECODE_CHECKED_DEPTH2
    # (six starts on one machine); AMXINT8, 1.78x RAWINT4's bytes,
    # decoded 1.31x it: its token grew by 1.26 times the extra floor, not 2, so part of the "floors" is a per-layer
    # cost that does not scale with bytes (one run: not refitted). A MoE layer costs both modes about two floors; the
    # fits differ by a fixed ~4.6 ms a token (CUDA graphs measured 2.2 ms of it) and 0.3 ms a layer, the latter
    # within the machines' spread.
    serve_decode_token_s: dict[str, float] = Field(default_factory=lambda: {"lora": 0.00603, "merged": 0.00145})
    serve_decode_floors: dict[str, float] = Field(default_factory=lambda: {"lora": 2.149, "merged": 2.006})
    # The highest read bandwidth measured on any host (GB/s; the 64-core host above): the power law of
    # kt_read_gb_s is not extended past it for serving (read bandwidth saturates; 98 / 144 / 138 GB/s at
    # 16 / 32 / 64 threads on that host).
    serve_read_gb_s_ceiling: float = 149.7
    # KT's whole step on the host planned for, relative to the machine of the fit: 1 as shipped;
    # what the host's own runs measured where it has some (ktflow.planning.host_speed).
    kt_host_factor: float = 1.0
    # KT's CPU expert passes (forward and backward) on the host planned for, relative to the machine of the fit,
    # from kt-kernel's own SFT kernels timed there (ktflow.planning.host_probe): 1 as shipped, and where the host
    # has KT runs (their factor above covers the whole step).
    kt_cpu_factor: float = 1.0
    # What that probe measures on a machine the time model fits exactly, as its measured / predicted seconds, by
    # kt-kernel SFT method: the probe's ratio on a host divided by this is the host's kt_cpu_factor. A method
    # without one is not scaled by its probe (the plan says so). The machine of the fit was never probed, so it is
    # estimated from hosts with both a probe and a KT run (benchmarks/probe_reference.py, its data in
    # benchmarks/data/plan-probe/): RAWINT4, the Kimi-K2.5 slice at 1 MoE layer, 5 steps on an H200 + 16-core host
    # (1.157) and an H200 + 64-core host (1.096); each estimate put the other host's step within 5 % (+4.6 %,
    # -3.5 %; as fitted: -4.8 %, -8.2 %).
    kt_probe_reference: dict[str, float] = Field(default_factory=lambda: {"RAWINT4_SFT": 1.127})


COSTS = CostModel()
"""The constants ktflow plans with."""


# Bytes a routed-expert parameter occupies as sglang-kt's --kt-method reads it from CPU RAM: its expert format's.
SERVE_BYTES_PER_PARAM: dict[str, float] = {
    method: KT_BYTES_PER_PARAM[fmt]
    for method, fmt in {"RAWINT4": "rawint4", "AMXINT8": "int8", "AMXINT4": "int4", "FP8": "fp8", "BF16": "bf16",
                        "AMXBF16": "bf16"}.items()}


class DecodeEstimate(BaseModel):
    """One sequence's decode rate on the serving host (concurrency 1), from the decode floor."""

    method: str
    active_bytes_per_token: int  # the routed experts one token activates, as the method stores them
    read_gb_s: float  # the host's read bandwidth at the serving threads, as the plan models it
    threads: int
    floor_tokens_per_s: float  # reading those bytes once a token, nothing else
    tokens_per_s: float  # a fixed cost a token + a multiple of the floor, by mode (CostModel.serve_decode_*)
    basis: str


# What the merged decode fit's checks on runs not used measured (benchmarks/data/merged-serving/decode-model.json):
# how many, and their decode over the fit's rate in the 4-bit formats (all; those at 2 MoE layers) and in AMXINT8.
# The plan's basis quotes them.
DECODE_CHECKS, DECODE_CHECKED_4BIT, DECODE_CHECKED_DEPTH2, DECODE_CHECKED_INT8 = 19, "0.99-1.18", "0.99-1.07", "1.31"

SERVE_DECODE_MODES = {"lora": "lora", "merged": "merged", "base": "merged"}
"""Serving modes and the decode constants each uses: the base model is served as merged weights are (graphs on)."""


def serve_decode_estimate(size: ModelSize, method: str, threads: int,
                          costs: CostModel | None = None, mode: str = "lora") -> DecodeEstimate | None:
    """Decode tokens/s of one sequence served with KT CPU experts, in serving ``mode`` (``lora``, ``merged`` or
    ``base``)."""
    costs = costs or COSTS
    if method not in SERVE_BYTES_PER_PARAM or not size.moe_layers or not size.routed_experts:
        return None
    fit = SERVE_DECODE_MODES[mode]
    per_expert = size.expert_parameters / size.moe_layers / size.routed_experts
    active = int(size.moe_layers * size.experts_per_token * per_expert * SERVE_BYTES_PER_PARAM[method])
    read = min(host_rate(costs.kt_read_gb_s, threads), costs.serve_read_gb_s_ceiling)
    floor = read * 1e9 / max(active, 1)
    token_s, floors = costs.serve_decode_token_s[fit], costs.serve_decode_floors[fit]
    seconds = token_s + floors / floor
    rate = 1 / seconds
    how = ("KT's LoRA path, CUDA graphs off" if fit == "lora" else
           "no LoRA flags (merged weights or the base model), CUDA graphs on")
    basis = (f"decode at concurrency 1, {mode} ({how}): {active / 1e9:.2f} GB of routed experts a token ({method}) "
             f"read at {read:.0f} GB/s ({threads} threads) is a floor of {floor:.1f} tokens/s; ~{rate:.1f} tokens/s "
             f"predicted ({token_s * 1e3:.2f} ms + {floors:.2f} floors a token: fitted at the default serving threads "
             "on Kimi-K2.5 slices of 1 and 2 MoE layers on 16-core hosts, "
             + (f"the merged fit checked on {DECODE_CHECKS} runs not used, which decoded {DECODE_CHECKED_4BIT}x its rate "
                f"in 4-bit formats ({DECODE_CHECKED_DEPTH2}x at 2 MoE layers) and {DECODE_CHECKED_INT8}x in AMXINT8 "
                "(the floors overstate more bytes)"
                if fit == "merged" else
                "no run left to check this mode's fit")
             + "; benchmarks/data/merged-serving/decode-model.json)")
    return DecodeEstimate(method=method, active_bytes_per_token=active, read_gb_s=round(read, 1), threads=threads,
                          floor_tokens_per_s=round(floor, 2), tokens_per_s=round(rate, 2),
                          basis=basis)


def host_rate(table: dict[int, float], threads: float) -> float:
    """A rate measured at a few thread counts (``table``), at ``threads``: a power law between the
    two nearest points, the nearest segment's exponent outside them."""
    points = sorted(table)
    if threads in table:
        return table[int(threads)]
    if len(points) == 1:
        return table[points[0]] * threads / points[0]
    below = [p for p in points if p < threads]
    above = [p for p in points if p > threads]
    lo, hi = (below[-1], above[0]) if below and above else (points[-2], points[-1]) if below else (points[0], points[1])
    exponent = math.log(table[hi] / table[lo]) / math.log(hi / lo)
    return table[lo] * (threads / lo) ** exponent


def kt_pools(sft: SftConfig) -> int:
    """NUMA pools KT splits its threads and experts over (``kt_tp_enabled`` + ``kt_threadpool_count``)."""
    return sft.kt_config.effective_threadpool_count if sft.kt_config is not None else 1


def kt_expert_format(sft: SftConfig) -> str:
    return sft.kt_config.effective_weight_format if sft.kt_config is not None else "bf16"


class KtStepEstimate(BaseModel):
    """One optimizer step of KT LoRA SFT, predicted, by part (seconds per optimizer step)."""

    step_s: float
    kt_forward_s: float  # KT's MoE forward passes (the recompute included)
    kt_backward_s: float
    gpu_s: float  # the GPU and framework's part, the optimizer step included
    tokens_per_micro_batch: float
    micro_batches: int
    threads: int
    pools: int
    active_experts: float  # routed experts a micro-batch reaches in a MoE layer
    bytes_floor_s: float  # the experts' bytes x passes x micro-batches / read bandwidth
    flop_floor_s: float  # the expert FLOPs (forward + input gradient) / matmul rate

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_micro_batch * self.micro_batches / self.step_s


def kt_step_estimate(size: ModelSize, sft: SftConfig, threads: int, costs: CostModel = COSTS,
                     tokens_per_micro_batch: float | None = None,
                     active_experts: float | None = None) -> KtStepEstimate:
    """One optimizer step of KT 0.7 LoRA SFT on ``threads`` KT threads, by part.

    Args:
        tokens_per_micro_batch: tokens a micro-batch carries through the model, padding included
            (default: ``per_device_train_batch_size x cutoff_len``, the bound).
        active_experts: routed experts one micro-batch reaches in a MoE layer, on average over the
            layers (default: balanced routing's expectation, what a trained router aims at). A run's
            own count is in kt-kernel's timers (``active_experts`` a call, ``KT_SFT_PROFILE=1``).
    """
    micro_batches = sft.gradient_accumulation_steps
    tokens = float(tokens_per_micro_batch if tokens_per_micro_batch is not None
                   else sft.cutoff_len * sft.per_device_train_batch_size)
    threads = max(int(threads), 1)
    pools = max(kt_pools(sft), 1)
    per_pool = max(threads / pools, 1.0)
    read_bytes_s = pools * host_rate(costs.kt_read_gb_s, per_pool) * GB
    matmul_flops_s = pools * host_rate(costs.kt_matmul_tflops, per_pool) * 1e12
    layers = max(size.moe_layers, 1)
    experts = max(size.routed_experts, 1)
    top_k = min(max(size.experts_per_token, 1), experts)
    per_expert = size.expert_parameters / (layers * experts)
    # Only the experts some token is routed to are read: under balanced routing, all but (1 - k/E)^tokens.
    if active_experts is None:
        active = experts * (1 - (1 - top_k / experts) ** tokens)
    elif not 0 < active_experts <= experts:
        raise ValueError(f"active_experts={active_experts} is not within 0 < n <= {experts} (the routed experts)")
    else:
        active = float(active_experts)
    expert_format = kt_expert_format(sft)
    pass_bytes = costs.kt_pass_bytes_per_param.get(expert_format, costs.kt_pass_bytes_per_param["rawint4"])
    pass_floor = active * per_expert * pass_bytes / read_bytes_s
    bytes_floor = active * per_expert * KT_BYTES_PER_PARAM.get(expert_format, 2.0) / read_bytes_s
    flop_floor = tokens * top_k * 2 * per_expert / matmul_flops_s
    flop_factor = costs.kt_flop_factor_by_format.get(expert_format, costs.kt_flop_factor_by_format["rawint4"])
    recompute = not sft.disable_gradient_checkpointing and sft.kt_cpu_activation != "retain"
    forwards = 2 if recompute else 1
    forward = forwards * (costs.kt_forward_call_s + costs.kt_forward_bytes_floors * pass_floor
                          + costs.kt_forward_flop_floors * flop_factor * flop_floor)
    backward = (costs.kt_backward_call_s + costs.kt_backward_bytes_floors * pass_floor
                + costs.kt_backward_flop_floors * flop_factor * flop_floor)
    if kt_share_backward_bb(sft):
        backward += costs.kt_repack_wait_s_per_param * size.expert_parameters / layers
    if sft.fsdp_offload_params:
        gpu = costs.kt_gpu_offload_base_s + costs.kt_gpu_offload_s_per_gb * 2 * size.non_expert_parameters / GB
    else:
        passes = 4 if sft.disable_gradient_checkpointing else 6
        non_expert_matmul = size.non_expert_parameters - size.vocab_size * size.hidden_size
        gpu = costs.kt_gpu_base_s + passes * non_expert_matmul * tokens / costs.kt_matmul_flops_per_s
    scale = costs.kt_host_factor
    cpu = scale * costs.kt_cpu_factor  # the probe times KT's CPU passes only: the GPU's part is not scaled by it
    kt_forward = cpu * micro_batches * layers * forward
    kt_backward = cpu * micro_batches * layers * backward
    gpu_s = scale * (micro_batches * gpu + costs.kt_optimizer_step_s)
    return KtStepEstimate(
        step_s=kt_forward + kt_backward + gpu_s, kt_forward_s=kt_forward, kt_backward_s=kt_backward, gpu_s=gpu_s,
        tokens_per_micro_batch=tokens, micro_batches=micro_batches, threads=threads, pools=pools, active_experts=active,
        bytes_floor_s=micro_batches * layers * (forwards + 1) * bytes_floor,
        flop_floor_s=micro_batches * layers * 2 * flop_floor,
    )


def kt_step_seconds(size: ModelSize, sft: SftConfig, threads: int, costs: CostModel = COSTS,
                    tokens_per_micro_batch: float | None = None) -> float:
    """One optimizer step of KT 0.7 LoRA SFT, in seconds (:func:`kt_step_estimate`)."""
    return kt_step_estimate(size, sft, threads, costs, tokens_per_micro_batch).step_s


def hf_step_seconds(size: ModelSize, sft: SftConfig, costs: CostModel = COSTS,
                    tokens_per_step: int | None = None) -> float:
    """One optimizer step of plain LoRA SFT on the GPUs, in seconds."""
    micro_batches = sft.gradient_accumulation_steps
    tokens = tokens_per_step or sft.cutoff_len * sft.per_device_train_batch_size * micro_batches
    passes = 4 if sft.disable_gradient_checkpointing else 6
    flops = passes * size.active_parameters * tokens / max(sft.gpus, 1)
    return micro_batches * costs.hf_micro_batch_s + flops / costs.hf_flops_per_s
