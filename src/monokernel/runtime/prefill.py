"""Prefill for the monokernel: the prompt through every layer in chunks, K/V straight into the
kernel's bf16 cache [layers, kv_heads, max_len, head_dim].

It runs on the repacked matrices the kernel streams (``weights/repack.py``), each read as the
dense matrix its weight format gives (``WeightFormat.dense``; for bf16 the streamed tensor
itself): one QKV GEMM, the interleaved gate/up matrix as two strided GEMMs, the norm gains
as fp32 vectors or folded into the matrices, exactly as the kernel applies them. So prefill
and decode read the same weights and the original checkpoint tensors need not stay on the
GPU.

Precision (``precision``): activations are fp32 throughout (residual stream, norms, RoPE,
q/k-norm, biases, SiLU, GEMM outputs); what differs is what the GEMMs see.

* ``"split-qkv"`` (default): every GEMM takes bf16 operands with fp32 accumulation and fp32
  output (cuBLAS via torch.mm ``out_dtype``), except that the QKV projection's input is
  split into two bf16 terms (hi + lo, ~16 mantissa bits) and multiplied twice: its output
  is the K/V every later decode step reads, and this keeps most of the fp32 accuracy for
  ~10% more GEMM work. Attention: bf16 flash attention on the bf16 cache.
* ``"bf16"``: the same without the split; the fastest.
* ``"fp32"``: fp32 GEMMs on a transient fp32 copy of one weight matrix at a time and fp32
  attention: the old reference-on-fp32-weights path, many times slower (no tensor cores
  unless TF32 is switched on globally), for accuracy comparisons.

Measured on the CPU with the schedule interpreter as the decode kernel (Llama-3.2-1B shape,
random bf16 weights, 64-token prompt, first decode steps, rel L2 vs the fp32 reference):
bf16 7.0e-3, split-qkv 5.3e-3, fp32 4.5e-3; a pure bf16 forward (bf16 residual stream) put
~9e-3 on the decode logits (docs/perf-notes.md).

Chunking: a prompt of T tokens runs as ceil(T / chunk_tokens) passes; each chunk writes its
K/V and attends to the cache prefix [0, chunk end) with a bottom-right causal mask, so
activations stay O(chunk) and any start position works (prefix reuse prefills only the
suffix after the reused positions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill_attention import (
    causal_attention,
    flash_cache_attention,
    flash_cache_attention_ok,
    flash_split_ok,
    masked_attention,
    split_count,
)
from monokernel.runtime.prefill_attention_triton import (
    triton_attention_ok,
    triton_cache_attention,
)
from monokernel.runtime.prefill_graphs import PrefillGraphs, graphs_enabled
from monokernel.runtime.prefill_ops import (
    addmm_fp32_ok,
    probed_once,
    rms_norm_bf16,
    silu_mul_bf16,
)
from monokernel.runtime.prefill_qkv import ChunkRope, QkvEpilogue, fused_epilogue_ok
from monokernel.weights.formats import DEFAULT_FORMAT, PackedMatrix, get_format
from monokernel.weights.repack import Repacked

PRECISIONS: tuple[str, ...] = ("split-qkv", "bf16", "fp32")
DEFAULT_PRECISION = "split-qkv"
DEFAULT_CHUNK_TOKENS = 8192  # one graphed chunk up to 8k tokens (prefill_graphs.py)

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_OUT_DTYPE_OK: dict[int, bool] = {}  # CUDA device index -> torch.mm(out_dtype=fp32) works


def _cuda_out_dtype_ok(device: torch.device) -> bool:
    """Whether this torch has the bf16 x bf16 -> fp32 cuBLAS GEMM (torch.mm ``out_dtype``,
    torch >= 2.8). Probed once per device: without it the output is rounded to bf16 once
    more, which costs accuracy, not correctness."""

    def probe() -> bool:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        try:
            return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            return False

    return probed_once(_OUT_DTYPE_OK, device, probe)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def gemm_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, k] @ w [n, k]^T -> [T, n] fp32: operands rounded to bf16, fp32 accumulate."""
    xb, wb = _bf16(x), _bf16(w)
    if x.is_cuda:
        if _cuda_out_dtype_ok(x.device):
            return torch.mm(xb, wb.t(), out_dtype=torch.float32)
        return torch.mm(xb, wb.t()).float()
    # The CPU has no bf16 -> fp32 GEMM; bf16 values are exact in fp32, so this is the same
    # product with fp32 accumulation (how the CPU tests see the GPU's arithmetic).
    return xb.float() @ wb.float().t()


def gemm_bf16_acc(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """acc [T, n] fp32 += gemm_bf16(x, w): one GEMM with beta = 1 where cuBLAS takes it
    (prefill_ops.addmm_fp32_ok), so the sum needs no element-wise pass of its own."""
    if acc.is_cuda and addmm_fp32_ok(acc.device):
        torch.addmm(acc, _bf16(x), _bf16(w).t(), out_dtype=torch.float32, out=acc)
    else:
        acc += gemm_bf16(x, w)


def gemm_parts(parts: Sequence[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """(sum of parts) [T, k] @ w [n, k]^T -> [T, n] fp32, one bf16 GEMM a part, the later
    ones accumulated in place. With x as its hi + lo bf16 terms (prefill_ops.bf16_parts, as
    rms_norm_bf16 gives them for the split QKV) two bf16 GEMMs give the product of a
    ~16-bit-mantissa x with the bf16 weights."""
    out = gemm_bf16(parts[0], w)
    for part in parts[1:]:
        gemm_bf16_acc(out, part, w)
    return out


def gemm_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, k] fp32 @ w [n, k]^T in fp32 on a transient fp32 copy of w."""
    return x.float() @ w.float().t()


def gemm_fp32_acc(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    acc += gemm_fp32(x, w)


def _fewest_before(keys: int, t: int) -> int:
    """The fewest cached positions before a graphed suffix of ``t`` tokens whose graph reads
    ``keys`` cache rows (prefill_graphs.keys_bucket: the next power of two above the suffix's
    end, or the cache length): its end passed the power of two below ``keys``."""
    below = 1 << max(0, (keys - 1).bit_length() - 1)
    return max(0, below - t)


def _full_int32(value: int, device: torch.device) -> torch.Tensor:
    """[1] int32 on the device, by a fill kernel (no host copy: capturable in a graph)."""
    return torch.full((1,), value, dtype=torch.int32, device=device)


def checked_tokens(tokens: Sequence[int] | torch.Tensor, start: int, max_len: int) -> torch.Tensor:
    """A prefill's tokens as int64 (where they were, the host for a list); ValueError for
    none, or for positions [start, start + T) outside a cache of ``max_len``."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(list(tokens), dtype=torch.long)
    tokens = tokens.to(torch.long)
    t = tokens.shape[0]
    if t == 0:
        raise ValueError("prefill needs at least one token")
    if start < 0 or start + t > max_len:
        raise ValueError(
            f"prefill of positions [{start}, {start + t}) exceeds the cache ({max_len})"
        )
    return tokens


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a graphed chunk sits: pos [T] int64 positions on the device; for flash
    attention used [1] int32, the cache rows up to the chunk's end; else the cache rows
    [0, keys) attention reads and visible [T, keys], its causal mask."""

    pos: torch.Tensor
    keys: int
    used: torch.Tensor | None
    visible: torch.Tensor | None


class Prefiller:
    """Runs prompt chunks through the repacked model, writing K/V into ``k_cache``/``v_cache``
    ([layers, kv_heads, max_len, head_dim], any float dtype; the kernel's is bf16)."""

    def __init__(
        self,
        cfg: ModelConfig,
        packed: Repacked,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        precision: str = DEFAULT_PRECISION,
        graphs: bool | None = None,
    ) -> None:
        """``graphs``: replay CUDA graphs for prompts prefilled from position 0 in one chunk
        (prefill_graphs.py); default: on CUDA unless MONOKERNEL_PREFILL_GRAPHS=0."""
        if precision not in PRECISIONS:
            raise ValueError(f"prefill precision {precision!r}; choose from {PRECISIONS}")
        if chunk_tokens < 1:
            raise ValueError(f"prefill chunk_tokens must be >= 1; got {chunk_tokens}")
        want = (cfg.num_layers, cfg.num_kv_heads, k_cache.shape[2], cfg.head_dim)
        if tuple(k_cache.shape) != want or tuple(v_cache.shape) != want:
            raise ValueError(f"KV cache shape {tuple(k_cache.shape)}; expected {want}")
        self.cfg, self.p = cfg, packed
        self.k, self.v = k_cache, v_cache
        self.max_len = k_cache.shape[2]
        self.chunk_tokens = chunk_tokens
        self.precision = precision
        self._mm: Gemm = gemm_fp32 if precision == "fp32" else gemm_bf16
        self._mm_acc = gemm_fp32_acc if precision == "fp32" else gemm_bf16_acc
        # Bias, q/k-norm, RoPE, the cache append and q's cast: one Triton kernel a layer
        # where it runs (prefill_qkv.py), else PyTorch ops.
        fused = precision != "fp32" and fused_epilogue_ok(k_cache.device)
        self._epilogue = QkvEpilogue(
            cfg, packed.rope_cos, packed.rope_sin, k_cache, v_cache, fused=fused
        )
        # Attention operands: the cache's dtype for flash attention, fp32 for "fp32".
        self._attn_dtype = torch.float32 if precision == "fp32" else k_cache.dtype
        # FlashAttention-2 straight on the bf16 cache where this torch and GPU have it;
        # else SDPA on sliced, GQA-expanded copies.
        self._flash = (
            precision != "fp32"
            and k_cache.dtype == torch.bfloat16
            and flash_cache_attention_ok(k_cache.device)
        )
        # Where it runs (head_dim 64 and 128), the Triton kernel of prefill_attention_triton.py
        # in FA2's place; else FA2 split over the cached keys where few queries would leave
        # SMs idle (prefill_attention.split_count).
        self._triton = self._flash and triton_attention_ok(k_cache.device, cfg.head_dim)
        self._split = self._flash and not self._triton and flash_split_ok(k_cache.device)
        self._sms = (
            torch.cuda.get_device_properties(k_cache.device).multi_processor_count
            if k_cache.is_cuda
            else 1
        )
        if graphs is None:
            graphs = graphs_enabled(k_cache.device)
        self.graphs: PrefillGraphs | None = None
        if graphs:
            largest = min(chunk_tokens, self.max_len)
            self.graphs = PrefillGraphs(
                lambda tk: self._chunk(tk, 0), self._chunk_at, largest, self.max_len
            )

    def _weight(self, m: PackedMatrix) -> tuple[torch.Tensor, torch.Tensor | None]:
        """m as the GEMMs read it (WeightFormat.gemm_operands): the matrix and the scales of
        its rows (None for bf16), in fp32 where the prefill computes in fp32."""
        dtype = torch.float32 if self.precision == "fp32" else None
        return get_format(m.format).gemm_operands(m, dtype)

    def _project_acc(self, acc: torch.Tensor, x: torch.Tensor, m: PackedMatrix) -> None:
        """acc [T, rows] += x @ m^T."""
        w, s = self._weight(m)
        if s is None:
            self._mm_acc(acc, x, w)
        else:
            acc += self._mm(x, w) * s

    @torch.no_grad()
    def fitting_start(self, start: int, tokens: int) -> int:
        """The start at or before ``start`` from which to prefill ``tokens`` tokens meant for
        [start, start + tokens) so that a captured graph runs them
        (PrefillGraphs.fitting_start); ``start`` where no graph would."""
        if self.graphs is None:
            return start
        return self.graphs.fitting_start(start, tokens)

    def run(
        self, tokens: Sequence[int] | torch.Tensor, start: int, logits: bool = False
    ) -> torch.Tensor | None:
        """Prefill ``tokens`` at positions [start, start + T): writes their K/V into the cache
        (positions [0, start) must already hold the prefix) and returns the last token's
        logits [V] float32 when ``logits`` is set. Asynchronous on the current stream."""
        device = self.k.device
        tokens = checked_tokens(tokens, start, self.max_len).to(device)
        t = tokens.shape[0]
        x = None
        if self.graphs is not None:
            x = self.graphs.run(tokens, start)  # None: no graph for this size or start
        if x is None:
            for a in range(0, t, self.chunk_tokens):
                x = self._chunk(tokens[a : a + self.chunk_tokens], start + a)
        if not logits:
            return None
        assert x is not None
        return self.lm_head_logits(x[-1:])[0]

    def _chunk(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """One chunk through every layer; returns its residual stream [T, hidden] fp32."""
        rope = self.rope(start, start + tokens.shape[0])
        x = self.embed(tokens)
        for n in range(len(self.p.layers)):
            self.attention_block(x, n, start, rope)
            self.mlp_block(x, n)
        return x

    def _chunk_at(self, tokens: torch.Tensor, pos: torch.Tensor, keys: int) -> torch.Tensor:
        """_chunk with the positions as a device tensor and a fixed key count, so one CUDA
        graph serves any start (prefill_graphs.py)."""
        rope = self._epilogue.rope_at(pos)
        if self._flash:
            at = Placed(pos, keys, (pos[-1:] + 1).to(torch.int32), None)
        else:
            visible = torch.arange(keys, device=pos.device)[None, :] <= pos[:, None]  # [T, keys]
            at = Placed(pos, keys, None, visible)
        x = self.embed(tokens)
        for n in range(len(self.p.layers)):
            self.attention_block(x, n, 0, rope, at)
            self.mlp_block(x, n)
        return x

    # ---- the pieces of a chunk (runtime/prefill_tp.py runs them rank by rank) ------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The chunk's residual stream at the first layer: [T, H] fp32."""
        return self.p.embed[tokens].float()

    def rope(self, start: int, end: int) -> ChunkRope:
        """RoPE's tables for positions [start, end)."""
        return self._epilogue.rope(start, end)

    def attention_block(
        self,
        x: torch.Tensor,
        n: int,
        start: int,
        rope: ChunkRope,
        at: Placed | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Layer n's attention on the residual x [T, H]: its K/V into the cache, and the
        O-projection added to x, or where ``out`` is given to ``out`` alone, without the
        bias (a tensor-parallel rank's partial sum)."""
        lp = self.p.layers[n]
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        end = start + x.shape[0]
        wqkv, s = self._weight(lp.matrices["wqkv"])
        if self.precision == "fp32":
            qkv = gemm_fp32(F.rms_norm(x, (cfg.hidden_size,), lp.attn_gain, eps), wqkv)
        else:  # the norm's output as the GEMM's bf16 operand(s): hi, or hi + lo (split-qkv)
            split = self.precision == "split-qkv"
            qkv = gemm_parts(rms_norm_bf16(x, lp.attn_gain, eps, split), wqkv)  # [T, Q + 2KV]
        if s is not None:
            qkv *= s
        dt = self._attn_dtype
        q = self._epilogue(qkv, lp, n, rope, dt)  # [T, heads, d]; K/V written to the cache
        # Flash on the cache past position 0 only: from 0, SDPA's causal kernel on expanded
        # copies measured faster (8k-token prompt: 54.6 against 59.4 ms, H100).
        if self._flash and (at is not None or start > 0):
            used = at.used if at is not None else _full_int32(end, x.device)
            if self._triton:
                attn = triton_cache_attention(q, self.k[n], self.v[n], used)
            else:
                t = x.shape[0]
                splits = self._splits(t, start if at is None else _fewest_before(at.keys, t))
                attn = flash_cache_attention(q, self.k[n], self.v[n], used, splits)
        elif at is None:
            attn = causal_attention(q, self.k[n, :, :end].to(dt), self.v[n, :, :end].to(dt), start)
        else:
            assert at.visible is not None
            keys, values = self.k[n, :, : at.keys], self.v[n, :, : at.keys]
            attn = masked_attention(q, keys.to(dt), values.to(dt), at.visible)
        if out is not None:
            self._project_acc(out, attn, lp.matrices["wo"])
            return
        self._project_acc(x, attn, lp.matrices["wo"])  # x += O-projection [T, H]
        if lp.bo is not None:
            x += lp.bo

    def _splits(self, queries: int, prefix_keys: int) -> int:
        if not self._split:
            return 1
        return split_count(queries, self.cfg.num_heads, prefix_keys, self._sms)

    def mlp_block(self, x: torch.Tensor, n: int, out: torch.Tensor | None = None) -> None:
        """Layer n's MLP on the residual x [T, H], its down projection added to ``out`` (by
        default x itself)."""
        lp = self.p.layers[n]
        eps = self.cfg.rms_norm_eps
        if self.precision == "fp32":
            h = F.rms_norm(x, (self.cfg.hidden_size,), lp.ffn_gain, eps)
        else:
            (h,) = rms_norm_bf16(x, lp.ffn_gain, eps)  # rounded to bf16 once, used twice
        # wgu's rows interleave gate and up; strided views hand them to cuBLAS as two
        # matrices with a doubled leading dimension, so both outputs come out contiguous.
        wgu, s = self._weight(lp.matrices["wgu"])
        gate, up = self._mm(h, wgu[0::2]), self._mm(h, wgu[1::2])  # [T, I] fp32
        if s is not None:
            gate *= s[0::2]
            up *= s[1::2]
        if self.precision == "fp32":
            act = F.silu(gate, inplace=True)
            act *= up
        else:
            act = silu_mul_bf16(gate, up)  # [T, I] bf16, what the down GEMM reads
        self._project_acc(x if out is None else out, act, lp.matrices["wdown"])

    def lm_head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head on residual rows x [T, H]: logits [T, V] fp32 (a
        tensor-parallel rank's V: its vocabulary range)."""
        h = F.rms_norm(x, (self.cfg.hidden_size,), self.p.norm_gain, self.cfg.rms_norm_eps)
        w, s = self._weight(self.p.matrices["lm_head"])
        logits = self._mm(h, w)  # [1, V] fp32
        return logits if s is None else logits * s


def workspace_bytes(
    cfg: ModelConfig,
    chunk_tokens: int,
    max_len: int,
    precision: str,
    fmt: str = DEFAULT_FORMAT,
    head_fmt: str = DEFAULT_FORMAT,
) -> int:
    """Peak transient device memory of one prefill chunk (an upper bound, bytes): the chunk's
    fp32 activations and their GEMM-input copies, the GQA-expanded keys and values of the
    longest prefix, the logits; in "fp32" mode also the fp32 copies of the cache prefix and
    of the largest weight matrix; the dense bf16 copy of the largest matrix whose format is
    not read in place (``WeightFormat.packs_in_place``): a layer matrix in the layers' format
    ``fmt``, the LM head in ``head_fmt`` (bf16 under --quantize: read in place)."""
    t, f32 = chunk_tokens, 4
    h, i, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    # x, norm out (+ GEMM copies: hi, lo, x - hi), qkv, q/k after norm and RoPE (2 copies),
    # attention out (+ copy), o-proj out; the MLP: gate/up, act (+ copy), down out.
    attn_side = t * f32 * (3 * h + 2 * h + qkv + 2 * qkv + 2 * cfg.q_size + h)
    mlp_side = t * f32 * (2 * h + h + 2 * i + 2 * i + h)
    attn_bytes = f32 if precision == "fp32" else 2
    heads = cfg.num_heads if cfg.num_heads != cfg.num_kv_heads else 0  # expanded copies
    kv = 2 * (heads + (cfg.num_kv_heads if precision == "fp32" else 0))
    prefix = kv * max_len * cfg.head_dim * attn_bytes
    # The largest matrix, in elements: the LM head [V, H], gate/up [2I, H], QKV [Q + 2KV, H],
    # down [H, I] or O [H, Q] (max(rows) x max(columns) overstated it 5x on the 32B shape,
    # which then did not fit one 80 GB card with its int4 repacking).
    layer = max(2 * i * h, qkv * h, h * max(i, cfg.q_size))
    head = cfg.vocab_size * h
    dense = max(
        0 if get_format(fmt).packs_in_place else layer,
        0 if get_format(head_fmt).packs_in_place else head,
    )
    weight = torch.bfloat16.itemsize * dense
    if precision == "fp32":
        weight += max(layer, head) * f32
    return max(attn_side, mlp_side) + prefix + weight + f32 * cfg.vocab_size
