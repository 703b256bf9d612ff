"""The decode rules of the quantized checkpoint formats, as tensor kernels: compressed-tensors'
``pack-quantized`` symmetric INT4 (Kimi-K2/K2.5) and DeepSeek's block FP8, each to BF16 bit for bit
(the rules: shared/reference/checkpoints.md). The dequantize stage (ktflow/stages/dequantize.py)
streams whole checkpoints through them; they read and write tensors only.
"""

from __future__ import annotations

import threading

import torch

INT4_GROUP_SIZE = 32
FP8_BLOCK = (128, 128)


def _nibble_quad_table() -> torch.Tensor:
    """For each little-endian uint16 of packed data (4 nibbles = 4 columns), its 4 decoded codes
    ``nibble - 8`` as 4 BF16 values in one int64, the first column (lowest nibble) in the low bits.

    Gathering this 512 KB table once per 2 packed bytes writes BF16 columns in order, in half the
    gathers of a 256-entry byte-pair table (measured: 1.55 vs 2.4 ms per 2048x7168 matrix).
    """
    codes = (torch.arange(16, dtype=torch.float32) - 8).to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    i = torch.arange(65536)
    return codes[i & 0xF] | (codes[(i >> 4) & 0xF] << 16) | (codes[(i >> 8) & 0xF] << 32) | (codes[i >> 12] << 48)


_NIBBLE_QUADS = _nibble_quad_table()
# Output elements decoded per step (1 MB of BF16): the step's packed bytes, gather index and output
# stay in the CPU cache through read, gather, scale multiply and the page-cache write, instead of
# streaming three tensor-sized intermediates through memory. Measured on the 2-core EPYC, CPU s per
# 1.09 GB: 256K elements 0.43, 512K 0.41, 1M 0.41, 2M 0.63 (the whole-tensor decode it replaced: 0.5-1.9).
# Each step also costs some Python under the GIL, which all workers share: with many workers the
# steps must be bigger, or the GIL, not the cores, sets the pace. Measured on the 16-core Xeon, 16
# workers, 4.26 GB: 512K elements 3.0 GB/s, 2M 7.4, 4M 10.4, 8M 9.0 (no fsync).
_DECODE_CHUNK = 1 << 19
_MAX_DECODE_CHUNK = 1 << 22
_scratch = threading.local()


def _chunk_for(n_workers: int) -> int:
    """Elements per decode step for ``n_workers`` threads: 512K up to 2 workers, growing to 4M at 16."""
    return min(_MAX_DECODE_CHUNK, _DECODE_CHUNK * max(1, n_workers // 2))


def _set_thread_chunk(elements: int) -> None:
    _scratch.chunk = elements


def _decode_chunk() -> int:
    return getattr(_scratch, "chunk", _DECODE_CHUNK)


def _scratch_buffer(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch tensor ``name`` of at least ``n`` elements, reused across calls.

    Fresh multi-MB tensors per decode are mmap'd and unmapped by malloc each time: every page is
    faulted in again, which costs more than the decode itself.
    """
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:n]


def _decode_int4_rows(
    out: torch.Tensor, packed_rows: torch.Tensor, scale_rows: torch.Tensor, index: torch.Tensor, group_size: int
) -> None:
    """``out`` [r, cols] BF16 <- ``packed_rows`` (contiguous, r * cols / 2 bytes), ``scale_rows`` [r, cols / group].

    Only when :func:`_int4_fast_path` holds; ``index`` is int32 scratch of r * cols / 4 elements.
    """
    rows, cols = out.shape
    index.copy_(packed_rows.reshape(-1).view(torch.uint16))
    torch.index_select(_NIBBLE_QUADS, 0, index, out=out.view(-1).view(torch.int64))
    # bf16 * bf16 on CPU: fp32 product (exact: 4 x 8 significant bits), rounded once to bf16.
    out.view(rows, scale_rows.shape[1], group_size).mul_(scale_rows.unsqueeze(-1))


def _int4_fast_path(packed_words: int, scale_groups: int, cols: int, group_size: int) -> bool:
    """Whole int32 words and whole scale groups: every real Kimi tensor, decoded by the table gather."""
    return packed_words * 8 == cols == scale_groups * group_size


def decode_int4_pack_quantized(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    group_size: int = INT4_GROUP_SIZE,
    *,
    reuse_buffers: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one compressed-tensors ``pack-quantized`` symmetric INT4 weight to BF16.

    ``packed[r, w]`` (int32, little-endian) holds columns ``8w..8w+7``, column ``8w+j`` in bits
    ``4j..4j+3``; the stored nibble is ``q + 8``. ``W[r, c] = bf16(q * scale[r, c // group])``:
    the fp32 product is exact, so rounding it once equals compressed-tensors' bf16 multiply.

    With ``reuse_buffers`` the result is a view of this thread's scratch, valid until its next call;
    with ``out`` (contiguous BF16 ``shape``) it is decoded into ``out``, which is returned.
    """
    rows, cols = shape
    nbytes = packed.shape[1] * 4
    groups = scale.shape[1]
    as_bytes = packed.contiguous().view(torch.uint8).reshape(rows, nbytes)
    if _int4_fast_path(packed.shape[1], groups, cols, group_size):
        if out is None:
            out = (_scratch_buffer("out", rows * cols, torch.bfloat16) if reuse_buffers
                   else torch.empty(rows * cols, dtype=torch.bfloat16)).view(rows, cols)
        step = max(1, _decode_chunk() // max(cols, 1))
        index = _scratch_buffer("index", min(step, rows) * cols // 4, torch.int32)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            _decode_int4_rows(out[r0:r1], as_bytes[r0:r1], scale[r0:r1], index[: (r1 - r0) * cols // 4], group_size)
        return out
    nibbles = torch.empty((rows, nbytes, 2), dtype=torch.uint8)
    torch.bitwise_and(as_bytes, 0x0F, out=nibbles[:, :, 0])
    torch.bitwise_right_shift(as_bytes, 4, out=nibbles[:, :, 1])
    padded_cols = groups * group_size
    q = nibbles.view(rows, nbytes * 2)
    if q.shape[1] < padded_cols:  # odd shapes: pad so every scale group is whole
        q = torch.nn.functional.pad(q, (0, padded_cols - q.shape[1]), value=8)
    q = q[:, :padded_cols].to(torch.float32).sub_(8.0)
    decoded = q.view(rows, groups, group_size).mul_(scale.to(torch.float32).unsqueeze(-1))
    decoded = decoded.view(rows, padded_cols)[:, :cols].to(torch.bfloat16)
    return decoded if out is None else out.copy_(decoded)


def decode_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Decode one DeepSeek block-FP8 weight: ``W = bf16(float32(x) * scale_inv[i//128, j//128])``.

    Despite its name, ``scale_inv`` multiplies. Edge blocks may be partial in either dimension.
    """
    rows, cols = weight.shape
    br, bc = block
    x = weight.to(torch.float32)
    full_r, full_c = scale_inv.shape[0] * br, scale_inv.shape[1] * bc
    if (full_r, full_c) != (rows, cols):
        x = torch.nn.functional.pad(x, (0, full_c - cols, 0, full_r - rows))
    x = x.view(scale_inv.shape[0], br, scale_inv.shape[1], bc).mul_(scale_inv.to(torch.float32)[:, None, :, None])
    return x.view(full_r, full_c)[:rows, :cols].to(torch.bfloat16)
