"""CUDA graphs of the prefill for a fresh prompt: TTFT without the Python launch overhead.

An eager prefill chunk is ~35 small launches per layer (norms, the split QKV GEMM, RoPE,
cache writes, GQA expansion, attention, the MLP): ~600 for the Llama-3.2-1B shape, which
the host needs ~15 ms to issue while the GPU needs ~3 ms for a 1,024-token prompt. So a
prompt prefilled from position 0 in one chunk replays a graph captured for a bucket of
token counts (powers of two from 16 up to the chunk size): the tokens are padded to the
bucket with token 0. Padding sits *after* the real tokens, so causal attention keeps it out
of every real token's result; its K/V land in cache positions the request never reads
before the decode kernel overwrites them (the kernel writes position n-1+s before step s
attends), and the prefix cache never counts them as held.

Prefills that start past 0 (prefix reuse, later chunks of a long prompt) stay eager: their
attention length depends on the start.

Graphs are captured lazily, one per bucket the first time it is needed (a capture costs
about two eager prefills of that size), and share one memory pool: they never run at once.
``MONOKERNEL_PREFILL_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

MIN_BUCKET = 16


def graphs_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("MONOKERNEL_PREFILL_GRAPHS", "1") != "0"


def bucket_for(tokens: int, largest: int) -> int | None:
    """The smallest power of two >= tokens (at least MIN_BUCKET), or None above ``largest``."""
    if tokens < 1 or tokens > largest:
        return None
    b = MIN_BUCKET
    while b < tokens:
        b *= 2
    return b if b <= largest else None


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bucket] int64, the replay's input
    x: torch.Tensor  # [bucket, hidden] fp32, its residual stream out


class PrefillGraphs:
    """``chunk(tokens) -> x``: the eager forward of one chunk at position 0 (writes K/V);
    ``largest``: the largest bucket (the chunk size, capped by the cache length)."""

    def __init__(self, chunk: Callable[[torch.Tensor], torch.Tensor], largest: int) -> None:
        self._chunk = chunk
        self.largest = largest
        self._graphs: dict[int, _Graph] = {}
        self._pool: tuple[int, int] | None = None

    def run(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The residual stream [T, hidden] of ``tokens`` (int64 on the device) prefilled at
        position 0, or None when no bucket holds T (the caller runs it eagerly). The result is
        a view of the graph's static output: valid until the next replay."""
        t = tokens.shape[0]
        b = bucket_for(t, self.largest)
        if b is None:
            return None
        g = self._graphs.get(b) or self._capture(b)
        g.tokens[:t].copy_(tokens)
        g.tokens[t:].zero_()
        g.graph.replay()
        return g.x[:t]

    def _capture(self, bucket: int) -> _Graph:
        device = torch.device("cuda", torch.cuda.current_device())
        tokens = torch.zeros(bucket, dtype=torch.long, device=device)
        # Warm up on a side stream (cuBLAS handles and workspaces, attention kernel choice,
        # lazily built state) so that nothing is first-time during capture.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._chunk(tokens)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            x = self._chunk(tokens)
        self._pool = graph.pool()
        entry = _Graph(graph, tokens, x)
        self._graphs[bucket] = entry
        return entry

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
