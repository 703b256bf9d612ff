"""How much GPU memory a training run needs, from a checkpoint's config and safetensors headers.

The SFT preflight (``ktflow sft`` and ``ktflow doctor --recipe``) refuses a plain LoRA SFT
(``sft.backend: hf``) whose model cannot fit the GPUs it would use, before anything is loaded
or converted: plain LlamaFactory puts every weight on the GPU, in BF16 (transformers'
compressed-tensors loader decompresses INT4 for training, and ktflow's hf path trains on the
dequantized BF16 copy), where KTransformers keeps the routed experts in CPU RAM. The arithmetic
is in :func:`estimate_hf_sft_gpu_memory`, one typed function, so a planner can reuse it.

Nothing here reads tensor data: a 600 GB checkpoint is sized in a second.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, computed_field

from ktflow.formats.checkpoint import load_config, read_weight_map, text_config
from ktflow.formats.safetensors_io import read_header
from ktflow.host.hardware import HostInfo
from ktflow.recipe import Recipe, SftConfig
from ktflow.resources import GpuNeed, RamNeed, gpu_shortfall
from ktflow.units import GiB

# Companions of quantized weights: scales, shapes, zero points are not parameters.
_QUANT_METADATA = (".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_scale_inv")
# Weights that LoRA's "all" does not reach through LlamaFactory + transformers 5: embeddings and
# lm_head (not targets), the MoE router (not an nn.Linear), and routed experts (fused 3-D parameters).
_NOT_LORA = re.compile(r"(embed_tokens|lm_head|\.mlp\.gate\.|\.experts\.\d+\.|vision_tower|mm_projector)")
# A routed expert's tensor, per-expert (``.experts.3.gate_proj.weight``) or fused (``.experts.gate_up_proj``);
# shared experts (``.shared_experts.``) are dense and stay on the GPU under KT.
_ROUTED_EXPERT = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.")
# Bytes per trainable parameter under mixed-precision Adam: fp32 weight, gradient and two moments
# (LlamaFactory keeps trainable parameters in fp32 unless pure_bf16).
_TRAINABLE_BYTES = 16
# One decoder layer's activations per token and hidden unit, in bytes (BF16, attention by SDPA so no
# score matrix; after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models").
_LAYER_ACTIVATION_BYTES = 34
# Logits per token and vocabulary entry: BF16 output, the fp32 copy the loss takes, and its gradient.
_LOGIT_BYTES = 12
# CUDA context, cuBLAS workspace and the caching allocator's fragmentation.
_FIXED_OVERHEAD = GiB
_OVERHEAD_SHARE = 0.05


class ModelSize(BaseModel):
    """A checkpoint's size as a trainer sees it, from its config and headers alone."""

    path: str
    parameters: int  # every weight; INT4 and FP8 counted as the values they decode to
    hidden_size: int
    num_layers: int
    vocab_size: int
    linear_shapes: dict[str, tuple[int, int]]  # [out, in] of each Linear a LoRA may target (routed experts left out)
    expert_parameters: int = 0  # the routed experts' share of ``parameters`` (what KT keeps in CPU RAM)
    stored_bytes: int = 0  # every tensor as stored (INT4 packed, FP8, BF16), scales included
    expert_stored_bytes: int = 0  # the routed experts' share of ``stored_bytes``
    moe_layers: int = 0  # layers with routed experts
    routed_experts: int = 0  # per MoE layer (config: n_routed_experts / num_experts)
    experts_per_token: int = 0  # config: num_experts_per_tok
    kv_bytes_per_token: int = 0  # one token's BF16 KV cache over every layer (0: unknown); see kv_cache_geometry
    kv_latent: bool = False  # MLA: the cache is a latent each tensor-parallel rank keeps whole, not split by heads

    @property
    def expert_parameters_per_layer(self) -> int:
        return self.expert_parameters // max(self.moe_layers, 1)

    @property
    def expert_intermediate_size(self) -> int:
        """An expert's ``moe_intermediate_size``: an expert holds 3 x hidden x it parameters (0: no experts)."""
        experts = max(self.moe_layers, 1) * max(self.routed_experts, 1)
        return round(self.expert_parameters / experts / (3 * max(self.hidden_size, 1)))

    @property
    def active_parameters(self) -> int:
        """Matmul parameters one token passes through: its experts and every non-expert Linear
        (the embedding is a lookup)."""
        active_experts = self.expert_parameters * self.experts_per_token // max(self.routed_experts, 1)
        return active_experts + self.non_expert_parameters - self.vocab_size * self.hidden_size

    @property
    def non_expert_parameters(self) -> int:
        """Attention, dense MLPs, shared experts, routers, embeddings and lm_head: what KT puts on the GPU."""
        return self.parameters - self.expert_parameters


class GpuMemoryEstimate(BaseModel):
    """What a training run holds on its GPUs at peak, in bytes, by component."""

    weights_bytes: int
    trainable_bytes: int
    activation_bytes: int
    overhead_bytes: int
    trainable_parameters: int
    tokens_per_step: int

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.trainable_bytes + self.activation_bytes + self.overhead_bytes


def _parameters_of(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> int:
    """How many model parameters one stored tensor holds."""
    if name.endswith(".weight_packed"):
        return nbytes * 2  # two INT4 values per byte, whatever the container dtype
    if name.endswith(_QUANT_METADATA):
        return 0
    return math.prod(shape)


def kv_cache_geometry(config: dict) -> tuple[int, bool]:
    """``(bytes, latent)``: one token's KV cache in BF16 over every layer of a text config, and whether it is
    an MLA latent (``kv_lora_rank``: the compressed KV plus the shared RoPE key, which every tensor-parallel
    rank keeps whole) rather than per-head keys and values (split over the ranks by KV head).
    ``(0, False)`` where the config does not say enough.
    """
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("kv_lora_rank"):
        return layers * (int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)) * 2, True
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads if heads else 0))
    return layers * 2 * kv_heads * head_dim * 2, False


def model_size(path: str | Path) -> ModelSize:
    """Size the checkpoint in ``path`` from its config and shard headers.

    Raises:
        CheckpointError: no config, no index or single file, a missing shard or a bad header.
    """
    path = Path(path)
    weight_map, _ = read_weight_map(path)
    tensors = ((name, info.dtype, tuple(info.shape), info.nbytes)
               for shard in sorted(set(weight_map.values())) for name, info in read_header(path / shard).tensors.items())
    return _size_of(str(path), text_config(load_config(path)), tensors)


def hub_model_size(repo_id: str, revision: str = "main", *, token: str | None = None, endpoint: str | None = None,
                   cache_dir: str | Path | None = None) -> ModelSize:
    """Size a hub model before downloading it: its config.json and its shards' safetensors headers
    (huggingface_hub reads each header with an HTTP range request; no weights are fetched).

    Raises:
        huggingface_hub's errors: the repo, revision or files cannot be reached, or it is not a
        safetensors repo.
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    metadata = api.get_safetensors_metadata(repo_id, revision=revision)
    config = json.loads(Path(api.hf_hub_download(repo_id, "config.json", revision=revision,
                                                 cache_dir=cache_dir)).read_text())
    tensors = ((name, info.dtype, tuple(info.shape), info.data_offsets[1] - info.data_offsets[0])
               for shard in sorted(metadata.files_metadata) for name, info in
               metadata.files_metadata[shard].tensors.items())
    return _size_of(f"{repo_id}@{revision}", text_config(config), tensors)


def _size_of(path: str, config: dict, tensors: Iterable[tuple[str, str, tuple[int, ...], int]]) -> ModelSize:
    """A :class:`ModelSize` from a text config and ``(name, dtype, shape, nbytes)`` of every tensor."""
    parameters = experts = stored = expert_stored = 0
    linear: dict[str, tuple[int, int]] = {}
    moe_layers: set[str] = set()
    for name, dtype, shape, nbytes in tensors:
        count = _parameters_of(name, dtype, shape, nbytes)
        parameters += count
        stored += nbytes
        routed = _ROUTED_EXPERT.search(name)
        if routed:
            experts += count
            expert_stored += nbytes
            moe_layers.add(routed.group(1))
        if len(shape) == 2 and name.endswith((".weight", ".weight_packed")) and not _NOT_LORA.search(name):
            cols = nbytes // shape[0] * 2 if name.endswith(".weight_packed") else shape[1]
            linear[name.rsplit(".", 1)[0]] = (shape[0], cols)
    kv_bytes, kv_latent = kv_cache_geometry(config)
    return ModelSize(
        path=path, parameters=parameters, hidden_size=int(config.get("hidden_size") or 0),
        num_layers=int(config.get("num_hidden_layers") or 0), vocab_size=int(config.get("vocab_size") or 0),
        linear_shapes=linear, expert_parameters=experts, stored_bytes=stored, expert_stored_bytes=expert_stored,
        moe_layers=len(moe_layers),
        routed_experts=int(config.get("n_routed_experts") or config.get("num_experts") or
                           config.get("num_local_experts") or 0),
        experts_per_token=int(config.get("num_experts_per_tok") or 0),
        kv_bytes_per_token=kv_bytes, kv_latent=kv_latent,
    )


def _activation_bytes(size: ModelSize, sft: SftConfig, layer_bytes: float = _LAYER_ACTIVATION_BYTES) -> int:
    """One micro-batch's activations (a BF16 checkpoint per layer plus one layer's full activations
    under gradient checkpointing, every layer's without; ``layer_bytes`` per token and hidden unit of
    a layer) and its logits, for the longest micro-batch: ``cutoff_len x per_device_train_batch_size``."""
    tokens = sft.cutoff_len * sft.per_device_train_batch_size
    per_layer = int(tokens * size.hidden_size * layer_bytes)
    if sft.disable_gradient_checkpointing:
        layers = per_layer * size.num_layers
    else:
        layers = tokens * size.hidden_size * 2 * size.num_layers + per_layer
    return layers + tokens * size.vocab_size * _LOGIT_BYTES


def lora_parameters(size: ModelSize, *, target: str, rank: int) -> int:
    """Parameters of a rank-``rank`` LoRA on the Linear layers ``target`` names (``all``: every one)."""
    wanted = {t.strip() for t in target.split(",") if t.strip()}
    return sum(rank * (rows + cols) for module, (rows, cols) in size.linear_shapes.items()
               if "all" in wanted or module.rsplit(".", 1)[-1] in wanted)


def estimate_hf_sft_gpu_memory(size: ModelSize, sft: SftConfig) -> GpuMemoryEstimate:
    """GPU memory at the peak of a plain (HuggingFace backend) LlamaFactory SFT run of ``size``.

    Weights in BF16 (2 bytes per parameter); LoRA's trainable parameters with their gradients and
    Adam state (16 bytes each; full fine-tuning makes every parameter trainable); activations of
    one micro-batch (``cutoff_len`` x batch tokens: a BF16 checkpoint per layer plus one layer's
    full activations under gradient checkpointing, every layer's without) and its logits; CUDA
    context and allocator headroom (1 GiB + 5 % of the weights).

    On the H100 host, DeepSeek-V2-Lite's size (15.7B parameters, cutoff 1024, LoRA r=8 on the
    attention projections) measured 33,277 MiB over idle; this gives 34,000 MiB (tests check it).
    """
    tokens = sft.cutoff_len * sft.per_device_train_batch_size
    if sft.finetuning_type == "full":
        trainable = size.parameters
    else:
        trainable = lora_parameters(size, target=sft.lora_target, rank=sft.lora_rank)
    weights = 2 * size.parameters
    return GpuMemoryEstimate(
        weights_bytes=weights,
        trainable_bytes=_TRAINABLE_BYTES * trainable,
        activation_bytes=_activation_bytes(size, sft),
        overhead_bytes=_FIXED_OVERHEAD + int(weights * _OVERHEAD_SHARE),
        trainable_parameters=trainable,
        tokens_per_step=tokens,
    )


class KtSftMemoryEstimate(BaseModel):
    """What a KTransformers 0.7 SFT run holds at peak: GPU memory per GPU and the process tree's RSS."""

    gpu_bytes: int  # on each GPU
    rss_bytes: int
    gpu_why: str
    rss_why: str


# Measured on the H100 + 16-core AMX host (benchmarks/data/calibration.json, "host_rss" and
# "gpu_memory"): the KT process's own footprint (tiny legs: 3.07-3.13 GiB RSS; 1,445 MiB of GPU:
# CUDA context, KT's buffers), and RSS per byte of non-expert BF16 weights (the model loaded on
# the CPU, FSDP's copy and the optimizer: 2.5-3.6 per leg).
_KT_BASE_RSS = int(3.1 * GiB)
_KT_BASE_GPU = 1445 * (1 << 20)
_KT_NON_EXPERT_RSS_FACTOR = 3


class KtMemoryModel(BaseModel):
    """How KT SFT's GPU memory and RSS grow with the tokens of a micro-batch, fitted by
    benchmarks/kt_step_model.py on benchmarks/data/kt-throughput (``fit.json``; tests check the
    defaults equal its fit)."""

    # GPU without gradient checkpointing: bytes per token, decoder layer and hidden unit (the routed
    # experts' activations stay on the CPU), and what FSDP2 without parameter offload holds beyond
    # the formula at any length (unexplained by it: CUDA allocator pools, FSDP's buffers).
    gpu_layer_activation_bytes: float = 32.23
    gpu_no_offload_extra_bytes: int = 892 * (1 << 20)
    # RSS with kt_cpu_activation retain: bytes per token, MoE layer and routed intermediate unit
    # (top-k x moe_intermediate) that KT keeps on the CPU for the backward.
    rss_retained_bytes: float = 17.08


KT_MEMORY = KtMemoryModel()
"""The memory constants ktflow plans with."""

# KT on several GPUs (sft.gpus > 1): what each rank adds. The 57B bigger-than-GPU model on 1 / 2 / 4 H200s
# (benchmarks/data/multi-gpu) held 5,947 / 6,385 / 6,367 MiB a GPU: the non-expert weights are not divided over the
# ranks (each holds them whole) and a rank adds ~0.4 GiB (NCCL's buffers); the process tree's RSS grew 43.1 / 45.0 /
# 53.7 GiB: 3.5 GiB a further rank (fitted on those three runs, the 2-GPU one 1.6 GiB over; no other run checks it).
_KT_RANK_GPU_BYTES = 430 << 20
_KT_RANK_RSS_BYTES = int(3.53 * GiB)


# Said where BF16 experts are kept twice: the setting that keeps one copy, at its measured price
# (benchmarks/data/kt-throughput/out-of-sample: V2-Lite size, 4 x 256 tokens: RSS -40 %, step +14 %).
_SECOND_COPY = (" (a second, transposed BF16 copy: kt_share_backward_bb false; sft.kt_config.kt_share_backward_bb: "
                "true keeps one, measured at -40 % RSS for +14 % step time)")


def kt_share_backward_bb(sft: SftConfig) -> bool:
    """kt-kernel 0.7.2's default when the recipe leaves it unset: shared backward buffers for every
    expert format but rawint4 and mxfp4 (``kt_kernel.sft.config``)."""
    kt = sft.kt_config
    if kt is not None and kt.kt_share_backward_bb is not None:
        return kt.kt_share_backward_bb
    return (kt.effective_weight_format if kt is not None else "bf16") not in ("rawint4", "mxfp4")


def estimate_kt_sft_memory(size: ModelSize, sft: SftConfig, memory: KtMemoryModel = KT_MEMORY
                           ) -> KtSftMemoryEstimate:
    """GPU memory and host RSS at the peak of a KT 0.7 LoRA SFT run of ``size``.

    RSS: the routed experts as stored (twice for BF16 experts without shared backward buffers:
    kt-kernel then keeps a transposed copy; one layer's worth more with them), three times the
    non-expert weights in BF16, KT's own footprint, and with ``kt_cpu_activation: retain`` the
    routed experts' activations of the longest micro-batch (``cutoff_len x per_device_train_batch_size``
    tokens). GPU: the non-expert BF16 weights (with FSDP offload only the embeddings, lm_head and
    two layers are resident at once; without it, ~1 GiB more at any length, fitted), LoRA state,
    the longest micro-batch's activations and logits, and KT's fixed 1,445 MiB. Token slopes are
    fitted on benchmarks/data/kt-throughput (:class:`KtMemoryModel`), the rest on calibration.json's legs.
    """
    bf16_experts = (sft.kt_config.effective_weight_format if sft.kt_config else "bf16") == "bf16"
    share_bb = kt_share_backward_bb(sft)
    experts = size.expert_stored_bytes
    copies = 2 if bf16_experts and not share_bb else 1
    one_layer = experts // max(size.moe_layers, 1) if bf16_experts and share_bb else 0
    non_expert = 2 * size.non_expert_parameters
    tokens = sft.cutoff_len * sft.per_device_train_batch_size
    retained = kt_retained_activation_bytes(size, tokens, memory) if sft.kt_cpu_activation == "retain" else 0
    gpus = max(sft.gpus, 1)
    ranks = _KT_RANK_RSS_BYTES * (gpus - 1)
    rss = _KT_BASE_RSS + copies * experts + one_layer + _KT_NON_EXPERT_RSS_FACTOR * non_expert + retained + ranks
    embed = 2 * size.vocab_size * size.hidden_size
    if sft.fsdp_offload_params:
        per_layer = (size.non_expert_parameters - embed) // max(size.num_layers, 1)
        resident = 2 * (embed + 2 * per_layer)
    else:
        resident = non_expert + memory.gpu_no_offload_extra_bytes  # whole on every rank (measured; see above)
    if gpus > 1:
        resident += _KT_RANK_GPU_BYTES
    trainable = _TRAINABLE_BYTES * lora_parameters(size, target=sft.lora_target, rank=sft.lora_rank)
    activations = _activation_bytes(size, sft, memory.gpu_layer_activation_bytes if sft.disable_gradient_checkpointing
                                    else _LAYER_ACTIVATION_BYTES)
    gpu = resident + trainable + activations + _KT_BASE_GPU
    return KtSftMemoryEstimate(
        gpu_bytes=gpu, rss_bytes=rss,
        gpu_why=f"{resident / GiB:.1f} GiB of resident BF16 weights, "
                f"{trainable / GiB:.1f} GiB of LoRA state, {activations / GiB:.1f} GiB of activations "
                f"for {tokens} tokens a micro-batch, {_KT_BASE_GPU / GiB:.1f} GiB of CUDA context and KT buffers",
        rss_why=f"{copies * experts / GiB:.1f} GiB of routed experts as stored"
                f"{_SECOND_COPY if copies == 2 else ''}, "
                f"{_KT_NON_EXPERT_RSS_FACTOR * non_expert / GiB:.1f} GiB for the non-expert weights, "
                + (f"{retained / GiB:.1f} GiB of expert activations retained for {tokens} tokens, " if retained else "")
                + (f"{ranks / GiB:.1f} GiB for {gpus - 1} more rank(s), " if ranks else "")
                + f"{_KT_BASE_RSS / GiB:.1f} GiB of runtime",
    )


def kt_retained_activation_bytes(size: ModelSize, tokens: float, memory: KtMemoryModel = KT_MEMORY) -> int:
    """What KT keeps on the CPU for the backward of one micro-batch of ``tokens`` tokens
    (``kt_cpu_activation: retain``): ``rss_retained_bytes`` per token, MoE layer and routed
    intermediate unit (top-k x moe_intermediate, the latter from the experts' parameter count)."""
    return int(tokens * size.moe_layers * routed_intermediate_units(size) * memory.rss_retained_bytes)


def routed_intermediate_units(size: ModelSize) -> float:
    """top-k x moe_intermediate_size: an expert holds 3 x hidden x moe_intermediate parameters."""
    experts = max(size.moe_layers, 1) * max(size.routed_experts, 1)
    intermediate = size.expert_parameters / experts / (3 * max(size.hidden_size, 1))
    return size.experts_per_token * intermediate


def kt_sft_needs(size: ModelSize, sft: SftConfig) -> tuple[GpuNeed, RamNeed]:
    """The KT SFT stage's GPU and RAM needs (:func:`estimate_kt_sft_memory`), as its preflight checks them."""
    est = estimate_kt_sft_memory(size, sft)
    pools = sft.kt_config.effective_threadpool_count if sft.kt_config else 1
    return (GpuNeed(bytes=est.gpu_bytes, gpus=max(sft.gpus, 1), field="sft.gpus", what="KT SFT", why=est.gpu_why),
            RamNeed(bytes=est.rss_bytes, what="sft", why=est.rss_why, of="installed", numa_pools=pools))


def hf_sft_gpu_need(size: ModelSize, sft: SftConfig) -> GpuNeed:
    """The GPU memory a plain (``hf``) SFT of ``size`` needs, as the SFT stage declares it.

    The GPUs' memory is summed, a lower bound of what plain LlamaFactory needs: without DeepSpeed
    or FSDP it puts a whole copy of the model on every GPU.
    """
    need = estimate_hf_sft_gpu_memory(size, sft)
    return GpuNeed(
        bytes=need.total_bytes, gpus=sft.gpus, summed=True, field="sft.gpus", subject="sft.backend: hf",
        fix=HF_DOES_NOT_FIT_FIX,
        what=f"plain LoRA SFT puts the whole model on the GPU in BF16: {size.path} has {size.parameters / 1e9:.1f}B "
             "parameters, so it",
        why=f"{need.weights_bytes / GiB:.1f} GiB of BF16 weights, {need.trainable_bytes / GiB:.1f} GiB of trainable "
            f"weights, gradients and optimizer state, {need.activation_bytes / GiB:.1f} GiB of activations for "
            f"{need.tokens_per_step} tokens, {need.overhead_bytes / GiB:.1f} GiB of CUDA context and headroom",
    )


def sft_gpu_memory_problem(recipe: Recipe, host: HostInfo, checkpoint_dir: str | Path) -> str | None:
    """Why the recipe's plain SFT cannot fit this host's GPUs (None: it fits, or it does not apply).

    Applies to ``sft.backend: hf`` on GPUs only: KT keeps the routed experts in CPU RAM (its RAM is
    checked elsewhere), and a CPU run (``gpus: 0``) is sized against RAM. A host with fewer GPUs
    than ``sft.gpus`` is reported by the capability check instead. The need is
    :func:`hf_sft_gpu_need`, checked as the SFT stage's preflight checks it.

    Raises:
        CheckpointError: the checkpoint's config or headers cannot be read.
    """
    sft = recipe.sft
    if sft.backend != "hf" or sft.gpus == 0 or len(host.gpus) < sft.gpus:
        return None
    return gpu_shortfall("sft", hf_sft_gpu_need(model_size(checkpoint_dir), sft), host)


HF_DOES_NOT_FIT_FIX = (
    "set sft.backend: kt (KTransformers keeps the routed experts in CPU RAM and puts only the rest on the GPU; "
    "recipes/kimi-k2.5-rawint4.yaml is an example), or train on GPUs with more memory (sft.gpus)"
)
"""What to do when :func:`sft_gpu_memory_problem` finds a problem."""
