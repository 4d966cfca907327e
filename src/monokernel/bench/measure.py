"""What the benchmark measures: copy bandwidth, bytes per token, one timed request."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from monokernel.models.config import ModelConfig
from monokernel.runtime.backends.base import Backend, CancelToken, DecodeRequest, planned_reuse
from monokernel.runtime.sampling import SamplingParams
from monokernel.weights.formats import WeightFormat
from monokernel.weights.formats.fp8 import Fp8Rows
from monokernel.weights.formats.int4 import Int4Groups
from monokernel.weights.formats.int8 import Int8Rows
from monokernel.weights.quantize import config_format

if TYPE_CHECKING:
    from monokernel.runtime.constrained import TokenMatcher


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """HBM device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.randn(nbytes // 4, device=device)  # random data, never zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src), repeats)
    return 2 * nbytes / (ms / 1e3)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of ``fn``'s GPU work between two device events, over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    """Median ms of ``fn``'s GPU work replayed from a CUDA graph (warmed up on a side stream
    first), for micro-benchmarks of a few launches: timed eagerly, their host-side launch
    gaps would be counted too."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return _median_ms(graph.replay, repeats)


def layer_matrix_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The [out, in] shapes of one layer's streamed matrices: Q/K/V, O, gate/up, down."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def bytes_per_token(
    cfg: ModelConfig, context: float, weight_bytes: int = 2, fmt: str | None = None
) -> float:
    """Bytes one decode step must read: every matrix and norm once (the LM head once, the
    embedding table only as one row), plus the KV cache up to ``context`` positions. ``fmt``:
    the layers' matrices are stored in that weight format (weights/formats; its stored bytes,
    scales included), the rest at ``weight_bytes`` an element."""
    h, v = cfg.hidden_size, cfg.vocab_size
    params = cfg.num_parameters() - v * h + h  # drop the embedding table, keep one row
    if cfg.tie_word_embeddings:
        params += v * h  # the tied table is read whole as the LM head
    kv = cfg.num_layers * 2 * cfg.kv_size * context * weight_bytes
    if fmt is None:
        return params * weight_bytes + kv
    shapes = layer_matrix_shapes(cfg)  # QKV, O, gate/up, down
    if fmt == FP8_BLOCK:
        stages: list[WeightFormat] = [Fp8Rows(tiles=True, block=BLOCK_SIZE)] * 4
    elif fmt in INT8_GROUP_LABELS:
        stages = [Int8Rows(group=INT8_GROUP_LABELS[fmt])] * 4
    elif fmt == Q4_K_M:
        stages = [Int8Rows(group=16), Int4Groups(32), Int4Groups(32), Int8Rows(group=16)]
    else:
        stages = [config_format(fmt, cfg)] * 4
    matrices = cfg.num_layers * sum(r * c for r, c in shapes)
    stored = cfg.num_layers * sum(
        f.matrix_bytes(r, c) for f, (r, c) in zip(stages, shapes, strict=True)
    )
    return (params - matrices) * weight_bytes + stored + kv


@dataclass(frozen=True, slots=True)
class RunTiming:
    ttft_s: float  # request start -> first token on the host
    decode_s_per_token: float  # first token -> last token, per token after the first
    tokens: int
    reused_tokens: int | None = None  # prompt tokens a prefix cache supplied; None: unknown


def time_request(
    backend: Backend, prompt: list[int], gen_tokens: int, matcher: TokenMatcher | None = None
) -> RunTiming:
    """One greedy request; ``matcher``: its grammar (a ``+grammar`` engine's, fresh)."""
    sampling = SamplingParams(temperature=0.0)
    req = DecodeRequest(tuple(prompt), sampling, gen_tokens, frozenset(), matcher)
    reused = planned_reuse(backend, prompt)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    return time_tokens(backend.stream(req, CancelToken()), t0, reused=reused)


def time_tokens(
    tokens: Iterable[object], t0: float, limit: int | None = None, reused: int | None = None
) -> RunTiming:
    """TTFT and decode time a token of a stream of tokens whose request started at ``t0``
    (perf_counter), read to its end or ``limit`` tokens."""
    first = last = t0
    n = 0
    for _ in tokens:
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
        if n == limit:
            break
    return RunTiming(first - t0, (last - first) / max(n - 1, 1), n, reused)


# ``monokernel:fp8-block``: the weights as an FP8 checkpoint with BLOCK_SIZE x BLOCK_SIZE
# block scales would hold them (weights/checkpoint_quant.py fp8_block_checkpoint), run as
# the engine runs such a checkpoint: the monokernel streams them with their block scales.
FP8_BLOCK = "fp8-block"
BLOCK_SIZE = 128  # HF's fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3)
# ``monokernel:int8-g16`` / ``int8-g32``: the weights in 8 bits a group of 16 / 32 columns
# (weights/gguf_8bit.py quantize_groups8), run as the engine runs a GGUF file of 5- to 8-bit
# blocks: int8 groups of 16 (Q6_K, Q4_K_M, Q5_K_M) or 32 (Q8_0, Q5_K, Q5_0, Q5_1).
INT8_GROUP_LABELS: dict[str, int] = {"int8-g16": 16, "int8-g32": 32}
# ``monokernel:q4_k_m``: the layers as a GGUF Q4_K_M loads them, V and the down projection in
# 6 bits (here 8-bit groups of 16, as its Q6_K), the rest in 4 bits (int4 groups of 32, as
# its Q4_K): the QKV and down stages in int8 groups of 16 beside int4 tiles (GroupsPlan).
Q4_K_M = "q4_k_m"


def split_engine(label: str) -> tuple[str, str | None]:
    """A bench engine label -> (engine, weight format): ``monokernel:fp8`` is the monokernel
    with --quantize fp8; a label without a colon runs the checkpoint's weights. A ``@tpN``
    suffix (engine_tp) and a ``+grammar`` one (engine_grammar) are not part of either."""
    engine, _, fmt = label.partition("+")[0].partition("@")[0].partition(":")
    return engine, fmt or None


GRAMMAR_SUFFIX = "+grammar"


def engine_grammar(label: str) -> bool:
    """Whether a bench engine label's requests are constrained by ``--grammar``
    (``monokernel+grammar``)."""
    return label.endswith(GRAMMAR_SUFFIX)


def engine_tp(label: str) -> int:
    """The GPUs a bench engine label runs on: ``monokernel@tp2`` is the monokernel at
    --tp 2; 1 without the suffix. ValueError for a suffix that is not ``@tpN``, N >= 2."""
    _, at, spec = label.removesuffix(GRAMMAR_SUFFIX).partition("@")
    if not at:
        return 1
    if not (spec.startswith("tp") and spec[2:].isdigit() and int(spec[2:]) >= 2):
        raise ValueError(f"engine {label!r}: the suffix after @ is tpN with N >= 2 (@tp2)")
    return int(spec[2:])
