"""GGUF's 5-, 6- and 8-bit block types as 8-bit GroupQuants (weights/group_quant.py), and
one width for the layer matrices of a file that mixes them with 4-bit ones.

Each maps onto w = a * u + b per group, u in 0..255 one byte a weight, without changing a
value (a and b are products of an fp16 value and a small integer: exact in float32):

- Q8_0 (34 bytes a block of 32: fp16 d, int8 q[32]; w = d q): u = q + 128, a = d, b = -128 d;
- Q5_0 (22 bytes a block of 32: fp16 d, the 32 fifth bits, 16 bytes of nibbles;
  w = d (q - 16)): u = q, a = d, b = -16 d; Q5_1 (24 bytes: fp16 d and m first; w = d q + m):
  u = q, a = d, b = m;
- Q6_K (210 bytes a block of 256: 128 bytes of low nibbles, 64 of high bit pairs, int8
  scales[16], fp16 d; w = d sc (q - 32) per 16 weights): u = q, a = d sc, b = -32 d sc,
  groups of 16;
- Q5_K (176 bytes a block of 256: fp16 d and dmin, Q4_K's 12 bytes of 6-bit sub-block scales
  and mins, 32 bytes of fifth bits, 128 of nibbles; w = d sc q - dmin m per 32 weights):
  u = q, a = d sc, b = -dmin m, groups of 32.

Layouts as ggml's block structs and dequantisers define them (test_gguf_8bit.py checks each
against the gguf package's own dequantisation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from monokernel.weights.group_quant import (
    GGUF_ZERO_POINTS,
    GroupQuant,
    GroupQuantError,
    q4_k_scales_mins,
)

# Bytes and weights of a block, and the group each type's scales cover.
GGUF_8BIT_BLOCK_BYTES: dict[str, int] = {
    "Q8_0": 34,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q6_K": 210,
    "Q5_K": 176,
}
GGUF_8BIT_BLOCK_WEIGHTS: dict[str, int] = {
    "Q8_0": 32,
    "Q5_0": 32,
    "Q5_1": 32,
    "Q6_K": 256,
    "Q5_K": 256,
}
GGUF_8BIT_GROUP: dict[str, int] = {"Q8_0": 32, "Q5_0": 32, "Q5_1": 32, "Q6_K": 16, "Q5_K": 32}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes a row [n, 2] -> their fp16 value as float32 [n, 1]."""
    return b.contiguous().view(torch.float16).to(torch.float32)


# The decoders below work in uint8 with scalar shifts, a slice of the output at a time: a
# shift by a tensor of int64 amounts promotes the whole block to int64, 8 bytes a weight
# (a 32B model's Q6_K matrices took minutes so).


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4 bytes of fifth bits [n, 4] -> bit j of the little-endian word [n, 32]
    (bit j % 8 of byte j // 8)."""
    out = torch.empty(qh.shape[0], 4, 8, dtype=torch.uint8, device=qh.device)
    for bit in range(8):
        torch.bitwise_and(qh >> bit, 1, out=out[:, :, bit])
    return out.view(-1, 32)


def from_gguf_8bit(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> GroupQuant:
    """A GGUF Q8_0, Q5_0, Q5_1, Q6_K or Q5_K tensor's stored bytes (uint8, whole blocks in
    row-major order) as an 8-bit GroupQuant of ``shape`` [rows, cols]."""
    if kind not in GGUF_8BIT_BLOCK_BYTES:
        raise GroupQuantError(
            f"GGUF type {kind} is not one read as 8 bits; those are "
            f"{', '.join(GGUF_8BIT_BLOCK_BYTES)}"
        )
    per, size = GGUF_8BIT_BLOCK_WEIGHTS[kind], GGUF_8BIT_BLOCK_BYTES[kind]
    if len(shape) != 2 or shape[1] % per:
        raise GroupQuantError(f"a {kind} matrix must be 2-D with columns in {per}s; got {shape}")
    rows, cols = (int(s) for s in shape)
    if raw.dtype != torch.uint8 or raw.numel() != rows * cols // per * size:
        raise GroupQuantError(
            f"{kind} {shape} takes {rows * cols // per * size} bytes; "
            f"got {raw.numel()} of {raw.dtype}"
        )
    blocks = raw.reshape(-1, size)
    if kind == "Q8_0":
        d = _f16(blocks[:, 0:2])
        u = blocks[:, 2:] ^ 0x80  # int8 q + 128
        a, b = d, d * -float(GGUF_ZERO_POINTS[kind])
    elif kind in ("Q5_0", "Q5_1"):
        d = _f16(blocks[:, 0:2])
        at = 2 if kind == "Q5_0" else 4
        b = d * -float(GGUF_ZERO_POINTS[kind]) if kind == "Q5_0" else _f16(blocks[:, 2:4])
        high = _fifth_bits(blocks[:, at : at + 4]) << 4
        qs = blocks[:, at + 4 :]
        u = torch.cat((qs & 0x0F, qs >> 4), dim=1) | high  # nibbles: weights 0-15, then 16-31
        a = d
    elif kind == "Q6_K":
        u, a = _q6_k(blocks)
        b = a * -float(GGUF_ZERO_POINTS[kind])
    else:
        u, a, b = _q5_k(blocks)
    group = GGUF_8BIT_GROUP[kind]
    n = cols // group
    return GroupQuant(
        u.reshape(rows, cols).contiguous(),
        a.reshape(rows, n).contiguous(),
        b.reshape(rows, n).contiguous(),
        group,
        8,
    )


def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks [n, 210] -> q [n, 256] (0..63) and each 16's scale d sc [n, 16]. Each
    half of 128 weights has 64 bytes of low nibbles L and 32 of high pairs H: weight 32 r + l
    (r < 4, l < 32) is nibble (r >= 2) of L[l + 32 (r % 2)] with bits 2r, 2r + 1 of H[l] above."""
    n = blocks.shape[0]
    low = blocks[:, 0:128].reshape(n, 2, 2, 32)  # [n, half, r % 2, l]
    high = blocks[:, 128:192].reshape(n, 2, 32)  # [n, half, l]
    q = torch.empty(n, 2, 4, 32, dtype=torch.uint8, device=blocks.device)  # [n, half, r, l]
    for r in range(4):
        nib = low[:, :, r % 2]
        nib = nib & 0x0F if r < 2 else nib >> 4
        torch.bitwise_or(nib, ((high >> (2 * r)) & 3) << 4, out=q[:, :, r])
    sc = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210])
    return q.view(n, 256), d * sc


def _q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K blocks [n, 176] -> q [n, 256] (0..31) and each 32's d sc and -dmin m [n, 8].
    The 128 nibble bytes are 4 runs of 32: run j's low nibbles are sub-block 2j, its high
    nibbles sub-block 2j + 1; weight l of sub-block s has bit s of fifth-bit byte l."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = q4_k_scales_mins(blocks[:, 4:16])
    fifths = blocks[:, 16:48]  # [n, l]
    runs = blocks[:, 48:176].reshape(n, 4, 32)  # [n, run, l]
    q = torch.empty(n, 8, 32, dtype=torch.uint8, device=blocks.device)  # [n, sub-block, l]
    for s in range(8):
        nib = runs[:, s // 2]
        nib = nib & 0x0F if s % 2 == 0 else nib >> 4
        torch.bitwise_or(nib, ((fifths >> s) & 1) << 4, out=q[:, s])
    return q.view(n, 256), d * sc.to(torch.float32), -(dmin * mn.to(torch.float32))


def uniform_groups(groups: Mapping[str, GroupQuant]) -> dict[str, GroupQuant]:
    """The layer matrices of one file at one width and group a stage, as the kernel streams
    them (weights/quantize.py STAGE_MATRICES: the fused QKV, the down projection, the rest):
    a stage whose matrices are all 4 bits in one group as they are; any other in 8 bits, in
    the largest group dividing every one's (a Q4_K_M's V matrices, Q4_K's groups of 32 in
    some layers and Q6_K's 16s in others: the whole QKV stage in 8 bits, groups of 16)."""
    from monokernel.weights.quantize import STAGE_MATRICES, stage_groups

    out: dict[str, GroupQuant] = {}
    for name in STAGE_MATRICES:
        stage = stage_groups(groups, name)
        if not stage:
            continue
        if all(g.bits == 4 for g in stage.values()) and len({g.group for g in stage.values()}) == 1:
            out.update(stage)
            continue
        group = math.gcd(*(g.group for g in stage.values()))
        out.update(
            {
                k: g if (g.bits, g.group) == (8, group) else g.widened(group)
                for k, g in stage.items()
            }
        )
    return out


def quantize_groups8(w: torch.Tensor, group: int) -> GroupQuant:
    """``w`` [rows, cols] in 8 bits a group of ``group`` columns, asymmetric round to nearest
    (each group's minimum to its maximum in 255 steps): a matrix in the form a GGUF file's 5-
    to 8-bit blocks load in, for benchmarks and tests on weights no such file holds (bench's
    ``int8-g16`` and ``int8-g32``). A constant group gets step 1."""
    x = w.float().reshape(w.shape[0], -1, group)
    lo, hi = x.amin(dim=2), x.amax(dim=2)
    a = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(lo))
    q = torch.round((x - lo[:, :, None]) / a[:, :, None]).clamp_(0, 255)
    return GroupQuant(q.to(torch.uint8).reshape(w.shape), a, lo.contiguous(), group, 8)


def q4_k_m_groups(weights: Mapping[str, torch.Tensor]) -> dict[str, GroupQuant]:
    """Each layer matrix of ``weights`` as a GGUF Q4_K_M holds it, for benchmarks and tests on
    weights no such file holds (bench's ``q4_k_m``): V and the down projection in 6 bits (here
    8-bit groups of 16, Q6_K's width), the rest in 4 (int4 groups of 32, Q4_K's), each stage
    at one width as uniform_groups makes a file's."""
    from monokernel.weights.group_quant import quantize_rtn
    from monokernel.weights.quantize import is_quantized

    groups = {
        k: quantize_groups8(w, 16) if k.endswith((".wv", ".w_down")) else quantize_rtn(w, 32)
        for k, w in weights.items()
        if is_quantized(k)
    }
    return uniform_groups(groups)
