"""The schedule interpreter: the monokernel's stages and buffers, step for step, in PyTorch.

Same repacked weights (``weights/repack.py``), same stage order, same buffers (x, qkv, attn,
act, logits), same arithmetic choices (fp32 activations, the new key/value used from the
stage's own copy for the current position, the cache holding the weights' dtype). It runs
on the CPU, so the repack and the kernel's plan are tested without a GPU; on the GPU it is
the readable statement of what ``csrc/decode.cu``'s stages compute (one ``csrc/stage_*.cuh``
each: attn_norm_qkv, attention, o_proj, mlp_gate_up, mlp_down, lm_head). Two reassociations of the
kernel are not mirrored: attention split over position ranges and merged (flash-decoding),
and split-K row slices summed in shared memory; both compute the same sums. The rounding of
the vectors stages hand to each other (``handoff_round``: their low mantissa byte carries a
tag, ``csrc/flow.cuh``) is mirrored.
"""

from __future__ import annotations

import torch

from monokernel.models.config import ModelConfig
from monokernel.weights.repack import Repacked


def _rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def _normed_matvec(
    w: torch.Tensor, x: torch.Tensor, eps: float, gain: torch.Tensor | None
) -> torch.Tensor:
    """w @ RMSNorm(x) as the kernel computes it: the gain applied to the input, 1/rms to the
    dot products (``norm_scale`` in ``csrc/flow.cuh``)."""
    xg = x if gain is None else x * gain  # gain: only when repacked with fold=False
    return (w.float() @ xg) * torch.rsqrt(x.pow(2).mean() + eps)


def handoff_round(v: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to nearest on 16 significant bits, as ``st_flow`` stores a hand-off vector
    (flow.cuh); the freed low byte is the tag, which readers clear."""
    bits = v.float().contiguous().view(torch.int32)
    return ((bits + 0x80) & -256).view(torch.float32)


class ScheduleInterpreter:
    def __init__(self, cfg: ModelConfig, packed: Repacked, max_len: int) -> None:
        self.cfg, self.p = cfg, packed
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        dtype, dev = packed.embed.dtype, packed.embed.device
        self.k_cache = torch.zeros(shape, dtype=dtype, device=dev)  # [L, kvh, max_len, d]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=dev)  # [L, kvh, max_len, d]

    def _attention(self, n: int, qkv: torch.Tensor, pos: int) -> torch.Tensor:
        """Stage B for every head: qk-norm, RoPE, KV append, softmax(q k^T / sqrt d) v."""
        cfg, lp = self.cfg, self.p.layers[n]
        d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q = qkv[: cfg.q_size].view(nh, d)
        k = qkv[cfg.q_size : cfg.q_size + cfg.kv_size].view(nkv, d)
        v = qkv[cfg.q_size + cfg.kv_size :].view(nkv, d)
        if cfg.qk_norm:
            q = _rms(q, cfg.rms_norm_eps) * lp.q_norm
            k = _rms(k, cfg.rms_norm_eps) * lp.k_norm
        c, s = self.p.rope_cos[pos], self.p.rope_sin[pos]
        half = d // 2

        def rot(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t[:, :half], t[:, half:]
            return torch.cat((t1 * c - t2 * s, t2 * c + t1 * s), dim=-1)

        q, k = rot(q) * d**-0.5, rot(k)
        self.k_cache[n, :, pos] = k.to(self.k_cache.dtype)
        self.v_cache[n, :, pos] = v.to(self.v_cache.dtype)
        keys = self.k_cache[n, :, : pos + 1].float().clone()  # [kvh, pos+1, d]
        vals = self.v_cache[n, :, : pos + 1].float().clone()
        keys[:, pos], vals[:, pos] = k, v  # the stage's own fp32 copy for this position
        group = nh // nkv
        keys = keys.repeat_interleave(group, dim=0)
        vals = vals.repeat_interleave(group, dim=0)
        probs = torch.softmax(torch.einsum("hd,hsd->hs", q, keys), dim=-1)
        return torch.einsum("hs,hsd->hd", probs, vals).reshape(cfg.q_size)

    @torch.inference_mode()
    def step(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (the kernel's stages A-F); returns the logits [V] float32."""
        eps = self.cfg.rms_norm_eps
        x = self.p.embed[token].float()  # residual stream [h]
        r = handoff_round  # what one stage stores for the next
        for n, lp in enumerate(self.p.layers):
            qkv = _normed_matvec(lp.wqkv, x, eps, lp.attn_gain)  # A attn_norm_qkv [q + 2kv]
            if lp.bqkv is not None:
                qkv = qkv + lp.bqkv
            attn = r(self._attention(n, r(qkv), pos))  # B attention [q]
            o = lp.wo.float() @ attn  # C o_proj
            x = x + r(o + lp.bo if lp.bo is not None else o)
            gu = _normed_matvec(lp.wgu, x, eps, lp.ffn_gain)  # D mlp_gate_up [2i] interleaved
            act = r(torch.nn.functional.silu(gu[0::2]) * gu[1::2])  # [i]
            x = r(x + lp.wdown.float() @ act)  # E mlp_down
        return _normed_matvec(self.p.lm_head, x, eps, self.p.norm_gain)  # F lm_head [V]
