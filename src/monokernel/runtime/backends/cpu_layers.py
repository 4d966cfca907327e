"""The layers of the CPU's packed decode step (cpu_packed.py) as one TorchScript module.

A step of the default model is ~24 torch calls a layer, ~720 a token, each with 1.5-2 µs
of Python around it on a small CPU: ~1.7 ms of an ~18 ms token on 2 cores. Scripted, one
call runs every layer in TorchScript's interpreter instead; where TorchScript cannot
compile it (a torch without it, sources not shipped) the same module runs eagerly, with
the same arithmetic.

Written without ``from __future__ import annotations``: TorchScript reads the class
attributes' annotations as types, not strings. torch.compile, TorchScript's successor,
takes ~30 s to compile a layer here and recompiles per position (docs/benchmarks.md, "The
CPU engine").
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from monokernel.models.transformer import rms_norm

# A packed matrix's kind, as PackedLayers reads it (cpu_packed.PackedLinear.kind).
KINDS = {"float32": 0, "int8": 1, "int4": 2}
ACT = torch.bfloat16  # the integer kernels' fast activation dtype (_mm spells it out:
# TorchScript reads no global dtype)


def int8_input(x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """x [T, cols] with zero columns up to a packed int8 matrix's width (its rows' zero
    columns, cpu_packed.INT8_COLS)."""
    pad = data.shape[1] - x.shape[-1]
    if pad > 0:
        return F.pad(x, [0, pad])
    return x


class PackedLayers(nn.Module):
    """Every layer of a step over T tokens: updates the residual stream ``x`` [T, hidden]
    float32 in place and writes the T positions' cache rows. Flat lists, 2 norm gains and
    4 matrices (QKV, O, gate/up, down) a layer: TorchScript has no PackedLinear."""

    gains: list[torch.Tensor]
    kinds: list[int]
    data: list[torch.Tensor]
    scales: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    q_norms: list[torch.Tensor | None]
    k_norms: list[torch.Tensor | None]

    def __init__(
        self,
        group: int,
        heads: tuple[int, int, int],
        eps: float,
        gains: list[torch.Tensor],
        matrices: list[tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
        qk_norms: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    ) -> None:
        """``heads``: (query heads, KV heads, head dim); ``matrices``: (kind, data, scales,
        bias) as PackedLinear holds them; ``qk_norms``: a layer's Q and K norm gains."""
        super().__init__()
        self.group, self.eps = group, eps
        self.nh, self.kvh, self.d = heads
        none = torch.empty(0)
        self.gains = gains
        self.kinds = [KINDS[kind] for kind, _, _, _ in matrices]
        self.data = [data for _, data, _, _ in matrices]
        self.scales = [none if scales is None else scales for _, _, scales, _ in matrices]
        self.biases = [bias for _, _, _, bias in matrices]
        self.q_norms = [q for q, _ in qk_norms]
        self.k_norms = [k for _, k in qk_norms]

    def _mm(self, x: torch.Tensor, m: int) -> torch.Tensor:
        """Matrix m times x (cpu_packed.PackedLinear.__call__)."""
        kind = self.kinds[m]
        if kind == 2:
            y = torch._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.data[m], self.group, self.scales[m]
            )
        elif kind == 1:
            data = self.data[m]
            y = torch._weight_int8pack_mm(
                int8_input(x.to(torch.bfloat16), data), data, self.scales[m]
            )
        else:
            y = F.linear(x.float(), self.data[m])
        bias = self.biases[m]
        return y if bias is None else y + bias

    def _normed(
        self, x: torch.Tensor, n: int, m: int, h_act: torch.Tensor, h_f32: torch.Tensor
    ) -> torch.Tensor:
        """x normed with gain n (a gain times sqrt(hidden): x / ||x|| * gain), written in
        matrix m's input dtype: the rounding the kernel's .to() would do, one call less."""
        out = h_f32 if self.kinds[m] == 0 else h_act
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return torch.div(x * self.gains[n], norm, out=out)

    def forward(
        self,
        x: torch.Tensor,
        scratch: list[torch.Tensor],
        queries: list[torch.Tensor],
        k_rows: list[torch.Tensor],
        v_rows: list[torch.Tensor],
        keys: list[list[torch.Tensor]],
        values: list[list[torch.Tensor]],
    ) -> None:
        """``scratch``: cpu_packed._Scratch.tensors(); ``queries``: query i's heads
        [kvh, nh / kvh, d] (views of the rotated heads, scaled by 1/sqrt(d)); ``k_rows``,
        ``v_rows``: each layer's cache rows of the T positions [T, kvh, d]; ``keys[i]``,
        ``values[i]``: each layer's keys [kvh, d, S] (transposed) and values [kvh, S, d]
        over the S = start + i + 1 positions query i sees."""
        h_act, h_f32, heads, heads_flat, rot, cos = scratch[:6]
        heads_lo, heads_hi, rot_lo, rot_hi, sin_lo, sin_hi, k_new, v_new = scratch[6:]
        nh, kvh, d = self.nh, self.kvh, self.d
        t = x.shape[0]
        for n in range(len(k_rows)):
            m = 4 * n
            y = self._mm(self._normed(x, 2 * n, m, h_act, h_f32), m)
            q_norm, k_norm = self.q_norms[n], self.k_norms[n]
            if q_norm is not None and k_norm is not None:
                q, k, v = y.view(t, nh + 2 * kvh, d).split([nh, kvh, kvh], dim=1)
                q = rms_norm(q.float(), q_norm, self.eps)
                heads.copy_(torch.cat((q, rms_norm(k.float(), k_norm, self.eps), v), dim=1))
            else:
                heads_flat.copy_(y)  # float32 once, not in each op below
            # RoPE on all heads at once (cos 1 and sin 0 copy V's heads as they are), in
            # buffers whose halves are views made once, into the one whose views the cache
            # writes and the queries read: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
            torch.mul(heads, cos, out=rot)
            rot_lo.addcmul_(heads_hi, sin_lo)
            rot_hi.addcmul_(heads_lo, sin_hi)
            k_rows[n].copy_(k_new)
            v_rows[n].copy_(v_new)
            # A query at a time, over exactly the keys it sees: the same arithmetic whether
            # a token comes alone (decode) or with others (verification). Two products and a
            # softmax, each KV head's queries a row: ~15 µs a layer less than SDPA's kernel
            # at these sizes (~0.4 ms a token at 64-512 positions).
            out: list[torch.Tensor] = []
            for i in range(t):
                k_seen = keys[i][n]
                scores = torch.bmm(queries[i].to(k_seen.dtype), k_seen)
                out.append(torch.bmm(torch.softmax(scores, -1), values[i][n]).view(1, nh * d))
            x.add_(self._mm(out[0] if t == 1 else torch.cat(out), m + 1))
            gate_up = self._mm(self._normed(x, 2 * n + 1, m + 2, h_act, h_f32), m + 2)
            gate, up = gate_up.chunk(2, dim=-1)
            x.add_(self._mm(F.silu(gate) * up, m + 3))


def script(layers: PackedLayers) -> nn.Module:
    """``layers`` scripted, or as it is where TorchScript cannot compile it."""
    try:
        with warnings.catch_warnings():
            # Deprecated in favour of torch.compile, whose cost here the docstring gives.
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.script(layers)
    except (AttributeError, OSError, RuntimeError):
        return layers
