"""FP8 block checkpoints made from random weights, as their publishers quantise them (HF's
fine-grained FP8: each bm x bn block's largest magnitude onto E4M3's 448), for the tests of
block scales at every layer: the format, the repack, the shards and the kernel."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from monokernel.weights.checkpoint_quant import Fp8Blocks
from monokernel.weights.quantize import is_quantized

E4M3_MAX = 448.0


def block_quantize(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] (cols whole blocks) -> its E4M3 values and the float32 scales
    [ceil(rows / bm), cols / bn]; a partial last block of rows keeps its own amax."""
    rows, cols = w.shape
    wf = w.float()
    pad = torch.zeros(-rows % bm, cols, device=w.device)
    amax = torch.cat((wf, pad)).abs().view(-1, bm, cols // bn, bn).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = s.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)
    return (wf / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def dequantized(q: torch.Tensor, s: torch.Tensor, bm: int, bn: int) -> torch.Tensor:
    """q * its block's scale, float32 [rows, cols]."""
    return q.float() * s.repeat_interleave(bm, 0)[: q.shape[0]].repeat_interleave(bn, 1)


def fp8_blocks_of(
    weights: Mapping[str, torch.Tensor], bm: int, bn: int
) -> tuple[dict[str, torch.Tensor], Fp8Blocks]:
    """A block checkpoint made of ``weights``: the weights with each layer linear weight
    replaced by its dequantised values in float32 (what the loader hands over) and the
    block scales."""
    dense, scales = dict(weights), {}
    for name in [n for n in weights if is_quantized(n)]:
        q, scales[name] = block_quantize(weights[name], bm, bn)
        dense[name] = dequantized(q, scales[name], bm, bn)
    return dense, Fp8Blocks(bm, bn, scales)
