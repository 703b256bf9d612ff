"""Kimi-K2.5-format MoE checkpoints of any size, written one layer per shard with flat memory.

The tiny ``kimi-k2.5`` fixture (:mod:`ktflow.fixtures`) is made by transformers (a random
``DeepseekV3ForCausalLM``) and compressed-tensors (the INT4 packing): faithful, but the whole
model passes through memory, and compressed-tensors is not on a GPU host's offline bundle. This
module writes the same layout (tensor names, shapes, dtypes, shards, index; the caller adds the
config, tokenizer and remote code) at sizes where that is impossible: a ``bigger-than-gpu``
checkpoint holds 57B parameters, 114 GB in BF16.

- Every tensor is planned from :class:`MoeDims` up front (:func:`plan_shards`), so sizes and
  parameter counts are known without allocating anything (:func:`parameter_count`).
- Each tensor's values come from its own ``torch.Generator``, seeded from ``(seed, name)`` with 63
  bits, so the output does not depend on the number of workers or the order they run in.
- Shards are written one at a time by :class:`~ktflow.formats.safetensors_io.SafetensorsWriter` (header
  first, then each tensor at its offset) from a pool of threads, each tensor in pieces of at most
  :data:`CHUNK_ELEMENTS` elements: memory is a few pieces per worker, whatever the model size.
- Routed experts are drawn directly as packed INT4 codes and BF16 group scales in
  compressed-tensors' ``pack-quantized`` layout (column ``2k`` of a row in the low nibble of its
  byte ``k``, the stored nibble ``q + 8``); codes lie on Kimi's grid ``[-7, 7]`` and the group
  scales make the dequantized weights' std about :data:`WEIGHT_STD`, like the BF16 tensors'.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ktflow.formats.safetensors_io import DTYPE_SIZES, SafetensorsWriter, st_dtype
from ktflow.stages.dequantize import single_thread_torch

INT4_GROUP_SIZE = 32
WEIGHT_STD = 0.02  # transformers' initializer_range for DeepSeek-V3
BIAS_STD = 0.01  # the routing correction bias of the tiny kimi-k2.5 fixture (float32, like Kimi's)
CHUNK_ELEMENTS = 1 << 22  # one piece of a generated tensor: 16 MB of float32 scratch at most
# Codes are uniform on [-7, 7] except 0, which takes the draws of the unused code -8 too (E[q^2] = 17.5),
# and the group scales are log-normal around this mean, so that q * scale has a std of WEIGHT_STD.
_CODE_RMS = math.sqrt(2 * sum(k * k for k in range(1, 8)) / 16)
_SCALE_LOG_STD = 0.1
_SCALE_LOG_MEAN = math.log(WEIGHT_STD / _CODE_RMS) - _SCALE_LOG_STD**2  # E[s^2] = (WEIGHT_STD / _CODE_RMS)^2

Init = Literal["normal", "ones", "embedding", "bias", "int4_packed", "int4_scale", "int4_shape", "given"]
ProgressCallback = Callable[[int, int], None]


class MoeDims(BaseModel):
    """The dimensions of a DeepSeek-V3-architecture MoE (layer 0 dense, then MoE layers).

    Hidden and MoE intermediate sizes must be multiples of 128: INT4 groups are 32 wide, whole
    int32 words hold 8 columns, and kt-kernel's AMX kernels want multiples of 64 per thread pool.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: int = Field(ge=2, description="decoder layers; layer 0 is dense, the rest are MoE")
    experts: int = Field(ge=2, description="routed experts per MoE layer")
    experts_per_tok: int = Field(ge=1)
    shared_experts: int = Field(1, ge=1)
    hidden: int = Field(gt=0, multiple_of=128)
    moe_intermediate: int = Field(gt=0, multiple_of=128)
    intermediate: int = Field(gt=0, multiple_of=128, description="the dense layer's MLP width")
    heads: int = Field(ge=1)
    q_lora_rank: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)

    @model_validator(mode="after")
    def _routable(self) -> MoeDims:
        if self.experts_per_tok > self.experts:
            raise ValueError(f"experts_per_tok {self.experts_per_tok} exceeds experts {self.experts}")
        return self


BIGGER_THAN_GPU = MoeDims(
    # Kimi-K2.5's own widths (hidden 7168, MoE intermediate 2048, dense intermediate 18432, MLA with 64
    # heads, top-8 of the routed experts), with 8 layers of 180 routed experts instead of 61 of 384:
    # 57.1B parameters, 114 GB in BF16 (1.33x the 85.5 GB an H100 80GB reports), 34.4 GB as Kimi's INT4.
    layers=8, experts=180, experts_per_tok=8, hidden=7168, moe_intermediate=2048, intermediate=18432, heads=64,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
)
"""The ``bigger-than-gpu`` fixture size: more BF16 weights than an 80 GB GPU holds, INT4 that a 64 GB disk does."""


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the checkpoint: what it is called, how it is stored and how its values are made."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    init: Init
    std: float = WEIGHT_STD
    pad_row: int | None = None  # embedding: transformers zeroes the padding token's row
    content: tuple[int, ...] = ()  # int4_shape: the [rows, cols] it stores

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)

    @property
    def parameters(self) -> int:
        """Model parameters this tensor stores: a packed INT4 weight holds 8 per int32; its scale
        and shape are quantization metadata, not parameters."""
        if self.init == "int4_packed":
            return math.prod(self.shape) * 8
        return 0 if self.init in ("int4_scale", "int4_shape") else math.prod(self.shape)


def deepseek_v3_config(dims: MoeDims, *, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """The ``transformers.DeepseekV3Config`` of ``dims`` (the fixtures' text model, every size)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        moe_intermediate_size=dims.moe_intermediate,
        num_hidden_layers=dims.layers,
        first_k_dense_replace=1,
        n_routed_experts=dims.experts,
        n_shared_experts=dims.shared_experts,
        num_experts_per_tok=dims.experts_per_tok,
        n_group=1,
        topk_group=1,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.heads,
        q_lora_rank=dims.q_lora_rank,
        kv_lora_rank=dims.kv_lora_rank,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        num_nextn_predict_layers=0,  # no MTP layer is written
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )


# --------------------------------------------------------------------------- planning


def _linear(name: str, rows: int, cols: int) -> PlannedTensor:
    return PlannedTensor(f"{name}.weight", "BF16", (rows, cols), "normal")


def _norm(name: str, width: int) -> PlannedTensor:
    return PlannedTensor(f"{name}.weight", "BF16", (width,), "ones")


def _attention(dims: MoeDims, layer: str) -> list[PlannedTensor]:
    """MLA with a q LoRA, as DeepSeek-V3 and Kimi save it."""
    a = f"{layer}.self_attn"
    qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    return [
        _norm(f"{layer}.input_layernorm", dims.hidden),
        _norm(f"{layer}.post_attention_layernorm", dims.hidden),
        _linear(f"{a}.q_a_proj", dims.q_lora_rank, dims.hidden),
        _norm(f"{a}.q_a_layernorm", dims.q_lora_rank),
        _linear(f"{a}.q_b_proj", dims.heads * qk_head, dims.q_lora_rank),
        _linear(f"{a}.kv_a_proj_with_mqa", dims.kv_lora_rank + dims.qk_rope_head_dim, dims.hidden),
        _norm(f"{a}.kv_a_layernorm", dims.kv_lora_rank),
        _linear(f"{a}.kv_b_proj", dims.heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank),
        _linear(f"{a}.o_proj", dims.hidden, dims.heads * dims.v_head_dim),
    ]


def _mlp(prefix: str, width: int, hidden: int) -> list[PlannedTensor]:
    return [_linear(f"{prefix}.gate_proj", width, hidden), _linear(f"{prefix}.up_proj", width, hidden),
            _linear(f"{prefix}.down_proj", hidden, width)]


def _int4_expert(prefix: str, rows: int, cols: int) -> list[PlannedTensor]:
    """Kimi's routed expert weight: ``weight_packed`` (int32, 8 columns each), BF16 ``weight_scale``
    (one per group of 32 columns) and int32 ``weight_shape`` ``[rows, cols]``."""
    return [PlannedTensor(f"{prefix}.weight_packed", "I32", (rows, cols // 8), "int4_packed"),
            PlannedTensor(f"{prefix}.weight_scale", "BF16", (rows, cols // INT4_GROUP_SIZE), "int4_scale"),
            PlannedTensor(f"{prefix}.weight_shape", "I32", (2,), "int4_shape", content=(rows, cols))]


def _moe(dims: MoeDims, layer: str) -> list[PlannedTensor]:
    mlp = f"{layer}.mlp"
    tensors = [_linear(f"{mlp}.gate", dims.experts, dims.hidden),
               PlannedTensor(f"{mlp}.gate.e_score_correction_bias", "F32", (dims.experts,), "bias", std=BIAS_STD),
               *_mlp(f"{mlp}.shared_experts", dims.moe_intermediate * dims.shared_experts, dims.hidden)]
    for expert in range(dims.experts):
        e = f"{mlp}.experts.{expert}"
        tensors += _int4_expert(f"{e}.gate_proj", dims.moe_intermediate, dims.hidden)
        tensors += _int4_expert(f"{e}.up_proj", dims.moe_intermediate, dims.hidden)
        tensors += _int4_expert(f"{e}.down_proj", dims.hidden, dims.moe_intermediate)
    return tensors


def plan_shards(
    dims: MoeDims, *, vocab_size: int, pad_id: int, prefix: str = "language_model.", lm_head_std: float | None = None,
) -> list[list[PlannedTensor]]:
    """The language model's tensors, one shard per layer, as the tiny ``kimi-k2.5`` fixture places them.

    Embeddings go with layer 0, the final norm and lm_head with the last layer, and (as in real
    Kimi shards) the ``weight_scale`` of layer 1's first expert ``gate_proj`` lives in the next
    shard, away from its ``weight_packed``.
    """
    model = f"{prefix}model"
    shards: list[list[PlannedTensor]] = []
    for index in range(dims.layers):
        layer = f"{model}.layers.{index}"
        body = _mlp(f"{layer}.mlp", dims.intermediate, dims.hidden) if index == 0 else _moe(dims, layer)
        shards.append(_attention(dims, layer) + body)
    shards[0].append(PlannedTensor(f"{model}.embed_tokens.weight", "BF16", (vocab_size, dims.hidden), "embedding",
                                   pad_row=pad_id))
    shards[-1] += [_norm(f"{model}.norm", dims.hidden),
                   PlannedTensor(f"{prefix}lm_head.weight", "BF16", (vocab_size, dims.hidden), "normal",
                                 std=lm_head_std or WEIGHT_STD)]
    moved = f"{model}.layers.1.mlp.experts.0.gate_proj.weight_scale"
    scale = next(t for t in shards[1] if t.name == moved)
    shards[1].remove(scale)
    shards[2 % dims.layers].append(scale)
    return [sorted(shard, key=lambda t: t.name) for shard in shards]


def parameter_count(shards: list[list[PlannedTensor]]) -> int:
    """Parameters of a planned checkpoint (INT4 weights counted as the values they decode to)."""
    return sum(t.parameters for shard in shards for t in shard)


# --------------------------------------------------------------------------- values


def tensor_seed(seed: int, name: str) -> int:
    """The 63-bit seed of tensor ``name``'s own generator (a valid ``manual_seed``)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def random_int4_bytes(generator: torch.Generator, nbytes: int) -> torch.Tensor:
    """``nbytes`` packed INT4 bytes (two codes each, the low nibble first), codes on ``[-7, 7]``.

    Drawn as whole random bytes (8 per int64, ~30x faster than one draw per code); a nibble of 0
    (code -8, absent from real Kimi data) becomes 8 (code 0).
    """
    if nbytes % 8:
        raise ValueError(f"INT4 pieces are drawn 8 bytes at a time; {nbytes} bytes is not a multiple of 8")
    packed = torch.empty(nbytes // 8, dtype=torch.int64).random_(-(2**63), None, generator=generator).view(torch.uint8)
    # Per nibble n (both at once, no carry: 7 + 7 < 16): (n & 7) + 7 reaches bit 3 unless n & 7 == 0,
    # so bit 3 of ((n & 7) + 7) | n is clear exactly when n == 0; set it there (n = 8).
    zero = packed & 0x77
    zero += 0x77
    zero |= packed
    zero.bitwise_not_()
    zero &= 0x88
    packed |= zero
    return packed


def _rows_per_piece(shape: tuple[int, ...]) -> int:
    cols = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMENTS // max(cols, 1))


def tensor_pieces(tensor: PlannedTensor, seed: int, given: Mapping[str, torch.Tensor] | None = None) -> Iterator[memoryview]:
    """The bytes of ``tensor``, a few rows at a time (each piece valid until the next is asked for)."""
    if tensor.init == "given":
        yield _bytes_of((given or {})[tensor.name])
        return
    if tensor.init == "ones":
        yield _bytes_of(torch.ones(tensor.shape, dtype=torch.bfloat16))
        return
    if tensor.init == "int4_shape":
        yield _bytes_of(torch.tensor(tensor.content, dtype=torch.int32))  # Kimi ships int32 (compressed-tensors: int64)
        return
    generator = torch.Generator().manual_seed(tensor_seed(seed, tensor.name))
    rows = tensor.shape[0]
    step = _rows_per_piece(tensor.shape)
    row_shape = tensor.shape[1:]
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        yield _bytes_of(_draw(tensor, generator, (n, *row_shape), r0))


def _draw(tensor: PlannedTensor, generator: torch.Generator, shape: tuple[int, ...], row0: int) -> torch.Tensor:
    """Rows ``row0..`` of a generated tensor, ``shape`` being the piece's shape."""
    if tensor.init == "int4_packed":
        return random_int4_bytes(generator, math.prod(shape) * 4)
    if tensor.init == "int4_scale":
        return torch.empty(shape).log_normal_(_SCALE_LOG_MEAN, _SCALE_LOG_STD, generator=generator).to(torch.bfloat16)
    values = torch.randn(shape, generator=generator).mul_(tensor.std)
    if tensor.init == "embedding" and tensor.pad_row is not None and row0 <= tensor.pad_row < row0 + shape[0]:
        values[tensor.pad_row - row0].zero_()
    return values if tensor.init == "bias" else values.to(torch.bfloat16)


# --------------------------------------------------------------------------- writing


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def shard_names(count: int) -> list[str]:
    """``model-00001-of-0000N.safetensors`` ... as transformers names shards."""
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(
    shards: list[list[PlannedTensor]],
    out_dir: Path,
    *,
    seed: int,
    given: Mapping[str, torch.Tensor] | None = None,
    workers: int | None = None,
    fsync: bool = True,
    progress: ProgressCallback | None = None,
) -> dict[str, str]:
    """Generate and write ``shards`` into ``out_dir``, one shard at a time; return the weight map.

    Args:
        given: values of the tensors planned with ``init="given"`` (small ones made elsewhere).
        workers: threads generating and writing tensors (default: every CPU this process may use).
        fsync: flush each shard to disk before the next (a fixture made for a run should survive a crash).
        progress: ``progress(shards_done, shards_total)`` after each shard.

    Raises:
        OSError: the disk filled up or failed; the caller removes the partial directory.
    """
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    with single_thread_torch(), ThreadPoolExecutor(max_workers=workers or _usable_cpus()) as pool:
        for index, (shard, name) in enumerate(zip(shards, names)):
            _write_shard(pool, shard, out_dir / name, seed=seed, given=given, fsync=fsync)
            weight_map.update(dict.fromkeys((t.name for t in shard), name))
            if progress is not None:
                progress(index + 1, len(shards))
    return weight_map


def _write_shard(pool: ThreadPoolExecutor, shard: list[PlannedTensor], path: Path, *, seed: int,
                 given: Mapping[str, torch.Tensor] | None, fsync: bool) -> None:
    plan = [(t.name, t.dtype, t.shape) for t in shard]
    with SafetensorsWriter(path, plan, metadata={"format": "pt"}) as writer:
        # Largest first, so the pool ends a shard on small tensors instead of one worker on a big one.
        ordered = sorted(shard, key=lambda t: -t.nbytes)
        futures = [pool.submit(writer.write_pieces, t.name, tensor_pieces(t, seed, given)) for t in ordered]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        writer.close(fsync=fsync)


def given_tensors(tensors: Mapping[str, torch.Tensor]) -> list[PlannedTensor]:
    """Plan entries for tensors made elsewhere (the vision stand-in), written as they are."""
    return [PlannedTensor(name, st_dtype(t.dtype), tuple(t.shape), "given") for name, t in tensors.items()]
