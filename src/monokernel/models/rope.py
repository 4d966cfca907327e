"""Rotary position embedding tables, computed once per model (HF's non-interleaved layout)."""

from __future__ import annotations

import math

import torch

from monokernel.models.config import ModelConfig, RopeScaling


def llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scale(inv_freq, cfg.rope_scaling)
    return inv_freq


def rope_tables(
    cfg: ModelConfig, max_len: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, head_dim/2] float32; row p rotates position p."""
    inv_freq = inverse_frequencies(cfg).to(device)
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    angles = pos[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [T, head_dim/2]. Rotates (x[:d/2], x[d/2:])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
