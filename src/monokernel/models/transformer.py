"""The reference forward pass: every supported family in one short, plain PyTorch file.

This is the ground truth the `torch` and `monokernel` engines are tested against, so it
favours clarity over speed. Weights are a flat dict in our names (``weights/names.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.models.rope import apply_rope, rope_tables

# A model's tensors by our names ("embed", "layers.3.wq", ...): what the forward below reads.
# weights/names.py maps checkpoint names onto these and checks their shapes.
Weights = dict[str, torch.Tensor]


@dataclass(slots=True)
class KVCache:
    """Preallocated cache; positions [0, max_len) of every layer."""

    k: torch.Tensor  # [layers, kv_heads, max_len, head_dim]
    v: torch.Tensor  # [layers, kv_heads, max_len, head_dim]

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return gain * xf.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


# Prompt tokens a prefill forward (Transformer.prefill): bounds its attention scores.
PREFILL_CHUNK = 1024


class Float32View(Mapping[str, torch.Tensor]):
    """``weights`` read as float32, one tensor at a time: the reference then computes in
    float32 on bf16 weights with one layer's float32 matrices alive, not a float32 copy of
    the model (59 GB for a 14B one)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._w = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._w[name].float()

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


class Transformer:
    """Holds weights, config and RoPE tables; ``forward`` is stateless but for the cache."""

    def __init__(self, cfg: ModelConfig, weights: Weights, max_len: int) -> None:
        self.cfg = cfg
        self.w = weights
        ref = weights["embed"]
        self.dtype, self.device = ref.dtype, ref.device
        self.cos, self.sin = rope_tables(cfg, max_len, self.device)

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache.allocate(self.cfg, max_len, self.dtype, self.device)

    def _attention(self, x: torch.Tensor, n: int, start: int, cache: KVCache) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{n}."
        t = x.shape[0]
        q = linear(x, w[p + "wq"], w.get(p + "bq")).view(t, cfg.num_heads, cfg.head_dim)
        k = linear(x, w[p + "wk"], w.get(p + "bk")).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = linear(x, w[p + "wv"], w.get(p + "bv")).view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        cos, sin = self.cos[start : start + t], self.sin[start : start + t]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        end = start + t
        cache.k[n, :, start:end] = k.transpose(0, 1)
        cache.v[n, :, start:end] = v.transpose(0, 1)
        keys, values = cache.k[n, :, :end], cache.v[n, :, :end]  # [kvh, S, d]
        group = cfg.num_heads // cfg.num_kv_heads
        keys = keys.repeat_interleave(group, dim=0)
        values = values.repeat_interleave(group, dim=0)
        # Query i sits at absolute position start+i and sees keys 0..start+i.
        mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask
        )  # [heads, t, d]
        out = out.transpose(0, 1).reshape(t, cfg.q_size)
        return linear(out, w[p + "wo"], w.get(p + "bo"))

    def _mlp(self, x: torch.Tensor, n: int) -> torch.Tensor:
        w, p = self.w, f"layers.{n}."
        return linear(
            F.silu(linear(x, w[p + "w_gate"])) * linear(x, w[p + "w_up"]), w[p + "w_down"]
        )

    def prefill(
        self, tokens: torch.Tensor, cache: KVCache, chunk: int = PREFILL_CHUNK
    ) -> torch.Tensor:
        """A prompt [T] from position 0, ``chunk`` tokens a forward: the last position's logits
        [V] float32. One forward over a long prompt would materialise attention scores
        [heads, T, T] (128 GiB for 32k tokens of an 8B model); a chunk's are [heads, chunk, T]."""
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1; got {chunk}")
        t = tokens.shape[0]
        logits = None
        for a in range(0, t, chunk):
            logits = self.forward(tokens[a : a + chunk], a, cache, last_only=True)
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits[0]

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start: int, cache: KVCache, last_only: bool = False
    ) -> torch.Tensor:
        """tokens: [T] int64 at positions start..start+T-1 -> logits [T or 1, V] float32."""
        cfg, w = self.cfg, self.w
        if start + tokens.shape[0] > cache.max_len:
            raise ValueError(
                f"positions up to {start + tokens.shape[0]} exceed the cache ({cache.max_len})"
            )
        x = w["embed"][tokens]
        for n in range(cfg.num_layers):
            p = f"layers.{n}."
            x = x + self._attention(
                rms_norm(x, w[p + "attn_norm"], cfg.rms_norm_eps), n, start, cache
            )
            x = x + self._mlp(rms_norm(x, w[p + "ffn_norm"], cfg.rms_norm_eps), n)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, w["norm"], cfg.rms_norm_eps)
        head = w["embed"] if cfg.tie_word_embeddings else w["lm_head"]
        return linear(x, head).float()
