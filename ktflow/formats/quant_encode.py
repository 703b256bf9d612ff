"""The encode rule of compressed-tensors' ``pack-quantized`` symmetric INT4 (Kimi-K2/K2.5), the
inverse of :func:`ktflow.formats.quant_decode.decode_int4_pack_quantized`.

Kimi's scheme: groups of 32 inputs along a row, one BF16 scale per group, codes ``q`` in [-8, 7]
stored as ``q + 8`` nibbles, 8 to an int32 (column ``8w+j`` in bits ``4j..4j+3``), and
``W = bf16(q * scale)``. Kimi's own scales are ``absmax / 7`` (its data never uses -8).

The scale of a group is the BF16 value next to ``absmax / 7`` (that value, one BF16 step below or
above) whose nearest-grid codes reproduce the group best (smallest squared error of the decoded
BF16 values; ties keep ``absmax / 7``). For weights already on a grid (decoded from Kimi INT4:
``bf16(q * s)`` with some ``|q| = 7``) that search finds ``s`` again, because BF16 rounding of
``7 * s`` moves ``absmax / 7`` at most one BF16 step away from ``s``: encode(decode(x)) gives back
``x``'s packed codes and scales bit for bit. For other weights it is Kimi's rule, slightly refined.

Imports torch and ktflow.errors only: the drivers may use it inside the tools' environments.
"""

from __future__ import annotations

import torch

from ktflow.errors import InvalidInputError

INT4_GROUP_SIZE = 32
INT4_MAX = 7  # Kimi's grid: scale = absmax / 7, codes -7..7 (-8 is legal, never produced)
_ROWS_PER_STEP = 256  # rows encoded at once: a few MB of float32 intermediates, whatever the matrix


def _bf16_neighbours(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The BF16 values one step below and above each (positive, finite) BF16 ``scale``."""
    bits = scale.view(torch.int16)
    down = (bits - 1).view(torch.bfloat16)
    up = (bits + 1).view(torch.bfloat16)
    tiny = torch.finfo(torch.bfloat16).tiny
    return torch.where(down.float() >= tiny, down, scale), up


def int4_codes(weight: torch.Tensor, scale: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """The nearest-grid codes of ``weight`` [rows, cols] for ``scale`` [rows, cols / group]:
    ``clamp(round_half_even(float32(w) / float32(s)), -8, 7)`` as int8 (fp32 division, as
    compressed-tensors quantizes)."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // group_size, group_size)
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-8, 7)
    return q.view(rows, cols).to(torch.int8)


def int4_scales(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """Each group's BF16 scale (the module's docstring says which), [rows, cols / group]."""
    rows, cols = weight.shape
    w = weight.float().view(rows, cols // group_size, group_size)
    absmax = w.abs().amax(-1)
    tiny = torch.finfo(torch.bfloat16).tiny
    base = (absmax / INT4_MAX).to(torch.bfloat16)
    base = torch.where(base.float() >= tiny, base, torch.full_like(base, tiny))  # an all-zero group: any scale
    down, up = _bf16_neighbours(base)
    errors = []
    for candidate in (base, down, up):  # argmin keeps the first of equal errors: absmax / 7 wins ties
        c = candidate.float().unsqueeze(-1)
        q = torch.round(w / c).clamp_(-8, 7)
        decoded = (q * c).to(torch.bfloat16).float()
        errors.append((decoded - w).square_().sum(-1))
    pick = torch.stack(errors).argmin(0)
    return torch.where(pick == 0, base, torch.where(pick == 1, down, up))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [rows, cols] (cols % 8 == 0) in [-8, 7] -> compressed-tensors' int32 words [rows, cols / 8]."""
    rows, cols = codes.shape
    nibbles = (codes.to(torch.int16) + 8).to(torch.uint8).view(rows, cols // 2, 2)
    as_bytes = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)  # column 2k low nibble, 2k+1 high
    return as_bytes.contiguous().view(torch.int32).view(rows, cols // 8)


def encode_int4_pack_quantized(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode a weight [rows, cols] (BF16 or float32) as Kimi's pack-quantized INT4.

    Returns:
        ``(weight_packed int32 [rows, cols/8], weight_scale bf16 [rows, cols/group],
        weight_shape int32 [2])``, the three tensors a Kimi checkpoint holds per weight.

    Raises:
        InvalidInputError: the weight is not 2-D with whole groups of ``group_size`` columns, or it
            holds NaN or infinite values (no scale represents them).
    """
    if weight.dim() != 2 or weight.shape[1] % group_size or group_size % 8:
        raise InvalidInputError(f"weight {list(weight.shape)}",
                                f"is not a 2-D matrix of whole groups of {group_size} columns; Kimi's INT4 "
                                "encodes only those.", "keep such a weight in BF16")
    if not bool(torch.isfinite(weight).all()):
        raise InvalidInputError(f"weight {list(weight.shape)}", "holds NaN or infinite values, which INT4 cannot "
                                "encode.", "check the adapter and the base for NaN/inf weights")
    rows, cols = weight.shape
    packed = torch.empty(rows, cols // 8, dtype=torch.int32)
    scale = torch.empty(rows, cols // group_size, dtype=torch.bfloat16)
    for r0 in range(0, rows, _ROWS_PER_STEP):
        part = weight[r0:r0 + _ROWS_PER_STEP]
        s = int4_scales(part, group_size)
        scale[r0:r0 + _ROWS_PER_STEP] = s
        packed[r0:r0 + _ROWS_PER_STEP] = pack_int4(int4_codes(part, s, group_size))
    return packed, scale, torch.tensor([rows, cols], dtype=torch.int32)
