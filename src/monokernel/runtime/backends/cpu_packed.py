"""The torch engine's decode step on the CPU: each layer's matrices read as 4- or 8-bit
integers by PyTorch's own CPU kernels.

At batch 1 a decode step reads every weight once, so on a CPU the bytes a token set the
speed: the float32 step of the default model (SmolLM2-135M) reads ~540 MB a token, ~12
tokens/s on 2 cores. Here each matrix is packed once, at load, as

* int4 in groups of 32 with a scale and a zero each (``torch._weight_int4pack_mm_for_cpu``)
  when its values already lie on such a grid, as a Q4_1 GGUF's do once dequantised: the
  packing then loses only the bf16 rounding of each group's scale and zero;
* int8 with one bf16 scale a row (``torch._weight_int8pack_mm``) otherwise, and for the LM
  head (+0.3% perplexity for int8 layers on the default model);
* float32, as loaded, where a shape fits neither kernel (int4 needs rows % 16 == 0 and
  cols % 32 == 0; int8 cols % 8 == 0: other widths sum wrongly, or crash).

Both kernels want bf16 activations (float32 ones take a path ~10x slower), so each matrix
input is rounded to bf16; the residual stream, norms, RoPE, attention and the KV cache stay
float32, as in the reference. The head's bf16 logits carry ~3 significant digits, so the
top ``RESCORE`` candidates are scored again from the float32 table: greedy picks what the
float32 head would pick for that hidden state. A greedy step that needs no logits
(``PackedCpuStep.greedy``, what the engine runs for a plain greedy request) takes its
``PICK`` candidates from an int4 copy of the head instead, half the int8 one's bytes, and
scores them the same way: the same float32 pick wherever it ranks among the int4 head's
top PICK (on the default model it ranked at most 8th over 4,096 positions).

The prompt's prefill stays on the float32 reference (Transformer.prefill): for many tokens
float32 GEMMs beat these GEMV kernels on a CPU. A forward of several tokens here
(speculative verification) gives bitwise the logits of as many single steps, because both
kernels compute each input row on its own and attention runs a query at a time, so drafts
are accepted exactly when steps of ``__call__`` would have produced them. A greedy pass
(``greedy_tokens``) picks each position's token as ``greedy`` does, from the 4-bit head's
candidates (which also score each row on its own), so greedy drafts are accepted exactly
when greedy steps would have produced them. The int4 kernel's time jumps from 4 rows to 5:
on 1 core the default model's layer matrices took 1.5-2.0x a row's time for 4 rows,
2.0-2.6x for 5 and 2.8-3.1x for 8, and a whole pass ~1.3 steps for 3 tokens, ~2.0 for 4,
~2.8 for 5 (a draft of K = 4 verifies 5).

A step's torch calls are few (~24 a layer), write into buffers allocated once, and run in
one TorchScript call for all layers (cpu_layers.py): on a small CPU each call from Python
costs 2-6 µs, over 30 layers as much as a third of the matrices' time. Default model, 2
cores: ~17.5 ms a token, of which the int4 layers ~10 ms, the int4 head 2.4, attention ~1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.models.transformer import KVCache, Transformer
from monokernel.runtime.backends.cpu_layers import ACT, PackedLayers, int8_input, script
from monokernel.weights.group_quant import GroupQuant
from monokernel.weights.group_quant import fuse_rows as gq_fuse_rows

GROUP = 32  # weights sharing an int4 scale and zero: a Q4_1 block
# The int8 kernel's rows are stored padded with zero columns to a multiple of this (and each
# input row with zeros to match): torch 2.14's kernel (AVX-512) sums a row whose width is 8
# more than a multiple of 16 wrongly and may crash, where 2.13's took any multiple of 8.
INT8_COLS = 16
RESCORE = 16  # LM-head candidates scored again in float32
# Candidates a greedy step takes from the 4-bit head and scores in float32: on the default
# model the float32 head's pick ranked at most 8th among the 4-bit logits over 4,096
# positions of the packaged text (2nd among the int8 ones; the 4-bit head alone picks it at 87%).
PICK = 32
_ACT = ACT  # the kernels' fast activation dtype
# A float32 value is "on the grid" within this fraction of the grid's step: float32
# dequantisation (q * d + m) is off by a few ulps, an off-grid weight by up to half a step.
_GRID_TOL = 1e-3
# Buffers kept for forwards of up to this many tokens (decode, verification of drafts);
# longer ones (a perplexity window) allocate theirs.
_KEEP_SCRATCH = 32


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """``y = x W^T + b`` with W [rows, cols] stored as ``kind``."""

    kind: str  # "int4" | "int8" | "float32"
    # int4: the kernel's packed bytes; int8: [rows, cols rounded up to INT8_COLS], the
    # columns past cols zero; float32: W
    data: torch.Tensor
    scales: torch.Tensor | None  # int4: [cols/32, rows, 2] (scale, zero); int8: [rows]; bf16
    bias: torch.Tensor | None
    cols: int = 0  # int8: W's columns, without the padding

    @property
    def act_dtype(self) -> torch.dtype:
        """The dtype its input is rounded to (float32 matrices take theirs as it is)."""
        return torch.float32 if self.kind == "float32" else _ACT

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] -> [T, rows]: bf16 from the integer kernels (the next matrix reads
        bf16 anyway), float32 from a float32 matrix or with a bias."""
        if self.kind != "float32" and x.dtype != _ACT:  # a call saved when already bf16
            x = x.to(_ACT)
        if self.kind == "int4":
            y = torch._weight_int4pack_mm_for_cpu(x, self.data, GROUP, self.scales)
        elif self.kind == "int8":
            y = torch._weight_int8pack_mm(int8_input(x, self.data), self.data, self.scales)
        else:
            y = F.linear(x.float(), self.data)
        return y if self.bias is None else y + self.bias

    def dense(self) -> torch.Tensor:
        """The [rows, cols] float32 matrix the kernel multiplies by (for tests)."""
        if self.kind == "float32":
            return self.data
        if self.kind == "int8":
            assert self.scales is not None
            return self.data[:, : self.cols].float() * self.scales.float()[:, None]
        assert self.scales is not None
        cols = self.scales.shape[0] * GROUP
        # The kernel applied to the identity (its float32 path: exact sums) reads back the
        # values it dequantises, whatever its packed layout.
        eye = torch.eye(cols)
        return torch._weight_int4pack_mm_for_cpu(eye, self.data, GROUP, self.scales.float()).T


def int4_grid(
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [rows, cols] int32 in 0..15, scale, zero [rows, cols/32] float32) such that
    ``w = (q - 8) * scale + zero`` group by group, when every group of 32 in a row holds at
    most 16 evenly spaced values from its minimum to its maximum (a Q4_1 block's
    ``q * d + m``); None when a group does not, or the shape fits no int4 kernel."""
    rows, cols = w.shape
    if rows % 16 or cols % GROUP:
        return None
    # The first rows decide quickly for a matrix that was never 4-bit (most checkpoints).
    if rows > 16 and _on_grid(w[:16]) is None:
        return None
    return _on_grid(w)


def _on_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    q = torch.where(step > 0, (g - lo) / torch.where(step > 0, step, 1.0), 0.0).round()
    if ((q * step + lo - g).abs() > _GRID_TOL * step).any():
        return None
    return q.reshape(rows, cols).to(torch.int32), step[..., 0], (lo + 8 * step)[..., 0]


def _groups_grid(
    gq: GroupQuant,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """int4_grid's (q, scale, zero) from a matrix's own groups: w = a q + b is
    (q - 8) a + (b + 8 a)."""
    if gq.bits != 4 or gq.group != GROUP or gq.rows % 16:
        return None
    a = gq.scale.float()
    return gq.q.to(torch.int32), a, gq.offset.float() + 8 * a


def pack_int8(w: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear:
    """W [rows, cols] (cols % 8 == 0) as int8, symmetric, one bf16 scale a row; stored
    with zero columns up to a multiple of INT8_COLS."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, 1.0).to(_ACT)
    q = (wf / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    cols = q.shape[1]
    q = F.pad(q, (0, -cols % INT8_COLS))
    return PackedLinear("int8", q, scale, None if bias is None else bias.float(), cols)


def pack_int4_rtn(w: torch.Tensor) -> PackedLinear | None:
    """W [rows, cols] rounded to int4 in groups of 32, each group's 16 levels from its
    minimum to its maximum (a Q4_1 block's grid), or None where the shape fits no int4
    kernel. A few in-place passes: ~0.19 s for the default model's head on 2 cores, where
    quantize_rtn and the generic packing took ~0.4 s of the engine's start."""
    rows, cols = w.shape
    if rows % 16 or cols % GROUP:
        return None
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = torch.aminmax(g, dim=-1)
    step = ((hi - lo) / 15).clamp_min_(torch.finfo(torch.float32).tiny)
    q = (g - lo[..., None]).div_(step[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return _pack_int4(q.view(rows, cols), step, lo + 8 * step, None)


def _pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None
) -> PackedLinear:
    """w = (q - 8) * scale + zero, q [rows, cols] int32 in 0..15, scale and zero
    [rows, cols / 32] float32, in the int4 kernel's layout."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack((scale.T, zero.T), dim=-1).to(_ACT).contiguous()
    return PackedLinear("int4", packed, sz, None if bias is None else bias.float())


def candidates(
    logits: torch.Tensor, table: torch.Tensor, x: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``logits`` [T, rows] in each row (indices [T, k]) and their
    float32 products: rows of ``table`` [rows, cols] float32 with x [T, cols]."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices  # [T, k]
    rows = table.index_select(0, top.view(-1)).view(*top.shape, -1)
    return top, (rows * x[:, None, :]).sum(-1)


def best_row(coarse: PackedLinear, table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[T] int64: for each row of x [T, cols], the row of ``table`` [rows, cols] float32 with
    the largest float32 product among the PICK largest by ``coarse`` (table, packed)."""
    top, exact = candidates(coarse(x), table, x, PICK)
    return top.gather(1, exact.argmax(-1, keepdim=True)).view(-1)


def pack_linear(
    w: torch.Tensor, bias: torch.Tensor | None = None, gq: GroupQuant | None = None
) -> PackedLinear:
    """W [rows, cols] (any float dtype) in the best format its values and shape allow.
    ``gq``: W's own 4-bit groups (a checkpoint's, Checkpoint.groups), taken as they are
    where they are groups of 32 in a shape the int4 kernel takes, instead of finding W's
    grid again (~0.7 s of the default model's start)."""
    grid = _groups_grid(gq) if gq is not None else None
    if grid is None:
        grid = int4_grid(w)
    if grid is not None:
        return _pack_int4(*grid, bias)
    if w.shape[1] % 8 == 0:
        return pack_int8(w, bias)
    return PackedLinear("float32", w.float(), None, None if bias is None else bias.float())


class PackedCpuStep:
    """The decode step of ``TorchBackend`` on the CPU: the same buffers (``tok``, ``pos``)
    and the same contract as its ``_DecodeStep``, on packed matrices. Reads and writes the
    reference's KV cache, so the prompt's prefill can run on the reference.

    Its ops write into buffers allocated once per token count (_Scratch), whose views are
    taken once, and the views of the cache a step writes and reads are taken once a step
    for all layers: each view or allocation is another call."""

    def __init__(
        self,
        ref: Transformer,
        cache: KVCache,
        groups: Mapping[str, GroupQuant] | None = None,
    ) -> None:
        """``groups``: the checkpoint's own 4-bit groups of the layers' matrices, if any."""
        cfg, w = ref.cfg, ref.w
        self.cfg, self.cache = cfg, cache
        self.embed = w["embed"].float()
        self.head_table = self.embed if cfg.tie_word_embeddings else w["lm_head"].float()
        # int8 whatever the table holds: the top candidates are rescored anyway.
        self.head = pack_int8(self.head_table) if cfg.hidden_size % 8 == 0 else None
        # A greedy step needs only the float32 head's best token: it finds candidates in
        # int4 (half the int8 head's bytes, ~1.5 ms a token less on 2 cores), too coarse
        # for the logits sampling and perplexity read (+2.5% perplexity), and scores them.
        self.pick = pack_int4_rtn(self.head_table)
        self.norm = self._gain(w["norm"])
        # RoPE's tables over the whole head: (x1, x2) * cos2 + (x2, x1) * sin2.
        self.cos2 = torch.cat((ref.cos, ref.cos), dim=-1)[:, None, :]  # [max_len, 1, d]
        self.sin2 = torch.cat((-ref.sin, ref.sin), dim=-1)[:, None, :]
        # The queries' tables carry attention's 1/sqrt(d) (exact for d = 64, a power of 4).
        self.cos2_q = self.cos2 * cfg.head_dim**-0.5
        self.sin2_q = self.sin2 * cfg.head_dim**-0.5
        self.layers = [
            _Layer.pack(cfg, w, n, self._gain, groups or {}) for n in range(cfg.num_layers)
        ]
        self.run_layers = script(
            PackedLayers(
                GROUP,
                (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                cfg.rms_norm_eps,
                [g for lw in self.layers for g in (lw.attn_norm, lw.ffn_norm)],
                [
                    (m.kind, m.data, m.scales, m.bias)
                    for lw in self.layers
                    for m in (lw.qkv, lw.wo, lw.gate_up, lw.down)
                ],
                [(lw.q_norm, lw.k_norm) for lw in self.layers],
            )
        )
        self._scratch: dict[int, _Scratch] = {}
        self.tok = torch.zeros(1, dtype=torch.long)  # the input token; then the greedy next
        self.pos = torch.zeros(1, dtype=torch.long)  # the input token's position

    def _gain(self, g: torch.Tensor) -> torch.Tensor:
        # rms_norm(x) * g == x / ||x|| * (g * sqrt(h)) up to eps / (2 mean(x^2)) relative,
        # far below the bf16 rounding the result meets next; one norm call instead of six.
        return g.float() * self.cfg.hidden_size**0.5

    def _buffers(self, t: int) -> _Scratch:
        s = self._scratch.get(t)
        if s is None:
            s = _Scratch.allocate(self.cfg, t)
            if t <= _KEEP_SCRATCH:  # a decode step or a draft's verification, not a window
                self._scratch[t] = s
        return s

    @torch.inference_mode()
    def forward_tokens(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [T] int64 at positions start.. -> logits [T, V] float32 (the cache must
        hold positions < start)."""
        return self._logits(self._hidden(tokens, start))

    def _hidden(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The final norm's output [T, hidden] float32, what the LM head multiplies."""
        cache = self.cache
        t = tokens.shape[0]
        end = start + t
        s = self._buffers(t)
        # The step's position in the RoPE tables (V's heads keep cos 1, sin 0).
        s.cos_q.copy_(self.cos2_q[start:end])
        s.sin_q.copy_(self.sin2_q[start:end])
        s.cos_k.copy_(self.cos2[start:end])
        s.sin_k.copy_(self.sin2[start:end])
        # Every layer's cache rows for these positions as [T, kvh, d], like the new heads.
        k_rows = list(cache.k[:, :, start:end].transpose(1, 2).unbind(0))
        v_rows = list(cache.v[:, :, start:end].transpose(1, 2).unbind(0))
        # The keys and values query i sees, positions 0..start+i, of every layer.
        keys = [list(cache.k[:, :, : start + i + 1].transpose(2, 3).unbind(0)) for i in range(t)]
        values = [list(cache.v[:, :, : start + i + 1].unbind(0)) for i in range(t)]
        x = torch.index_select(self.embed, 0, tokens, out=s.x)
        # The graph interpreter without its optimising passes: the ops as written, bitwise
        # those of the eager module (no faster with them: keys grow a position a step).
        with torch.jit.optimized_execution(False):
            self.run_layers(x, s.tensors(), s.queries, k_rows, v_rows, keys, values)
        return x * self.norm / torch.linalg.vector_norm(x, dim=-1, keepdim=True)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return F.linear(x, self.head_table)
        logits = self.head(x).float()  # [T, V], within ~1% of the float32 head's
        top, exact = candidates(logits, self.head_table, x, RESCORE)
        return logits.scatter_(1, top, exact)

    def __call__(self) -> torch.Tensor:
        """Input ``tok`` at ``pos`` -> logits [V] float32; leaves the greedy next token in
        ``tok`` and advances ``pos``, as the GPU step does."""
        logits = self.forward_tokens(self.tok, int(self.pos))[0]
        self.pos.add_(1)
        self.tok.copy_(torch.argmax(logits).view(1))
        return logits

    @torch.inference_mode()
    def greedy(self) -> None:
        """``__call__`` without the logits: leaves in ``tok`` the token the float32 head
        would pick among the 4-bit head's top PICK, and advances ``pos``."""
        picks = self.greedy_tokens(self.tok, int(self.pos))
        self.pos.add_(1)
        self.tok.copy_(picks)

    @torch.inference_mode()
    def greedy_tokens(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens [T] int64 at positions start.. -> [T] int64: after each, the token
        ``greedy`` would pick there (a greedy verification pass: the same rows, each on its
        own, so the same picks as T greedy steps)."""
        x = self._hidden(tokens, start)
        if self.pick is None:
            return torch.argmax(self._logits(x), dim=-1)
        return best_row(self.pick, self.head_table, x)


@dataclass(frozen=True, slots=True)
class _Scratch:
    """One step's buffers for T tokens, and their views, made once."""

    x: torch.Tensor  # [T, hidden] float32: the residual stream
    h_act: torch.Tensor  # [T, hidden] bf16: a norm's output for the integer kernels
    h_f32: torch.Tensor  # [T, hidden] float32: for a float32 matrix
    heads: torch.Tensor  # [T, nh + 2 kvh, d] float32: Q, K and V before RoPE
    heads_flat: torch.Tensor  # heads as [T, (nh + 2 kvh) d], the QKV matrix's output
    rot: torch.Tensor  # [T, nh + 2 kvh, d] float32: Q, K after RoPE, and V
    cos: torch.Tensor  # [T, nh + 2 kvh, d]: the step's RoPE tables; 1 on V's heads
    sin: torch.Tensor  # [T, nh + 2 kvh, d]; 0 on V's heads
    cos_q: torch.Tensor  # cos's Q heads (what a step writes: with 1/sqrt(d))
    sin_q: torch.Tensor
    cos_k: torch.Tensor  # cos's K heads
    sin_k: torch.Tensor
    heads_lo: torch.Tensor  # the first and second halves of each head, of heads, rot, sin
    heads_hi: torch.Tensor
    rot_lo: torch.Tensor
    rot_hi: torch.Tensor
    sin_lo: torch.Tensor
    sin_hi: torch.Tensor
    k_new: torch.Tensor  # rot's K heads [T, kvh, d]
    v_new: torch.Tensor  # rot's V heads
    queries: list[torch.Tensor]  # query i's heads [kvh, nh / kvh, d], a KV head's group a row

    def tensors(self) -> list[torch.Tensor]:
        """The buffers and views PackedLayers.forward reads, in its order."""
        return [
            self.h_act, self.h_f32, self.heads, self.heads_flat, self.rot, self.cos,
            self.heads_lo, self.heads_hi, self.rot_lo, self.rot_hi, self.sin_lo,
            self.sin_hi, self.k_new, self.v_new,
        ]  # fmt: skip

    @classmethod
    def allocate(cls, cfg: ModelConfig, t: int) -> _Scratch:
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shape = (t, nh + 2 * kvh, d)
        heads, rot = torch.empty(shape), torch.empty(shape)
        cos, sin = torch.ones(shape), torch.zeros(shape)
        half = d // 2
        return cls(
            x=torch.empty(t, cfg.hidden_size),
            h_act=torch.empty(t, cfg.hidden_size, dtype=_ACT),
            h_f32=torch.empty(t, cfg.hidden_size),
            heads=heads,
            heads_flat=heads.view(t, -1),
            rot=rot,
            cos=cos,
            sin=sin,
            cos_q=cos[:, :nh],
            sin_q=sin[:, :nh],
            cos_k=cos[:, nh : nh + kvh],
            sin_k=sin[:, nh : nh + kvh],
            heads_lo=heads[..., :half],
            heads_hi=heads[..., half:],
            rot_lo=rot[..., :half],
            rot_hi=rot[..., half:],
            sin_lo=sin[..., :half],
            sin_hi=sin[..., half:],
            k_new=rot[:, nh : nh + kvh],
            v_new=rot[:, nh + kvh :],
            queries=[rot[i, :nh].view(kvh, nh // kvh, d) for i in range(t)],
        )


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor  # the norms' gains, times sqrt(hidden) (PackedCpuStep._gain)
    ffn_norm: torch.Tensor
    qkv: PackedLinear  # Q, K and V in one call, gate and up in one: fewer passes over x
    wo: PackedLinear
    gate_up: PackedLinear
    down: PackedLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None

    @classmethod
    def pack(
        cls,
        cfg: ModelConfig,
        w: Mapping[str, torch.Tensor],
        n: int,
        gain: Callable[[torch.Tensor], torch.Tensor],
        groups: Mapping[str, GroupQuant],
    ) -> _Layer:
        p = f"layers.{n}."

        def fused(*names: str) -> GroupQuant | None:
            parts = [groups.get(p + m) for m in names]
            return None if None in parts else gq_fuse_rows(*parts)  # type: ignore[arg-type]

        qkv_bias = None
        if cfg.qkv_bias:
            qkv_bias = torch.cat([w[p + "bq"], w[p + "bk"], w[p + "bv"]])
        q_norm, k_norm = w.get(p + "q_norm"), w.get(p + "k_norm")
        return cls(
            attn_norm=gain(w[p + "attn_norm"]),
            ffn_norm=gain(w[p + "ffn_norm"]),
            qkv=pack_linear(
                torch.cat([w[p + "wq"], w[p + "wk"], w[p + "wv"]]),
                qkv_bias,
                fused("wq", "wk", "wv"),
            ),
            wo=pack_linear(w[p + "wo"], w.get(p + "bo"), groups.get(p + "wo")),
            gate_up=pack_linear(
                torch.cat([w[p + "w_gate"], w[p + "w_up"]]), gq=fused("w_gate", "w_up")
            ),
            down=pack_linear(w[p + "w_down"], gq=groups.get(p + "w_down")),
            q_norm=None if q_norm is None else q_norm.float(),
            k_norm=None if k_norm is None else k_norm.float(),
        )
