"""CUDA graphs of the tensor-parallel prefill (runtime/prefill_tp.py) for a fresh prompt.

Eager, a TP=2 prefill of the Qwen2.5-Coder-1.5B shape is ~2,000 torch and Triton calls: ~33 ms
of host time whatever the prompt's length, against 3.5 ms for the one-GPU prefill's graph.
One graph per rank cannot hold the prefill, because the ranks exchange partial sums twice a
layer and a graph on one device cannot wait for another device's work. So each rank's
attention block and MLP block of each layer is a graph of its own, replayed in layer order,
and between them the host issues the exchange eagerly (ShardedPrefill.reduce: the peers'
partials copied over and added in rank order): 2·L·N replays and the exchanges' copies and
adds a prompt instead of every kernel's launch.

As in prefill_graphs.py, a prompt prefilled from position 0 pads to a bucket (powers of two
from 16 up to MAX_TP_BUCKET, or the chunk or cache length where that is smaller) with token 0
after the real tokens, whose K/V land in cache rows no request reads before the decode kernel
overwrites them. Each bucket has its static residual and partial buffers per rank; a rank's
graphs share one memory pool (replayed one after another, in the order they were captured).
Longer prompts and prompts after a held prefix run eagerly (GPU-bound at that size).
``warm`` captures every bucket at load (MONOKERNEL_PREFILL_WARMUP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill import workspace_bytes
from monokernel.runtime.prefill_graphs import bucket_for, buckets, capture_graph
from monokernel.weights.formats import DEFAULT_FORMAT

if TYPE_CHECKING:
    from monokernel.runtime.prefill_qkv import ChunkRope
    from monokernel.runtime.prefill_tp import ShardedPrefill

# Graphs for prompts up to this many tokens: past it the GPU's work outweighs the launches
# (and each bucket's buffers and captures cost memory and load time).
MAX_TP_BUCKET = 2048


def graph_bytes(
    rank: ModelConfig, chunk_tokens: int, max_len: int, precision: str, fmt: str = DEFAULT_FORMAT
) -> int:
    """One rank's memory for its block graphs: every bucket's residual and two partials
    [bucket, H] fp32, and the pool the largest bucket's blocks run in (as eager's workspace,
    its layers in the weight format ``fmt``)."""
    largest = min(MAX_TP_BUCKET, chunk_tokens, max_len)
    statics = 3 * 4 * rank.hidden_size * sum(buckets(largest)) if largest >= 1 else 0
    return statics + workspace_bytes(rank, largest, largest, precision, fmt)


@dataclass(slots=True)
class _Bucket:
    x: list[torch.Tensor]  # per rank [bucket, H] fp32: the residual stream, in and out
    attn: list[torch.Tensor]  # per rank [bucket, H] fp32: the attention block's partial
    mlp: list[torch.Tensor]  # per rank [bucket, H] fp32: the MLP block's partial
    ropes: list[ChunkRope]  # per rank: positions [0, bucket)
    graphs: list[list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]]]  # [layer][rank]


class ShardedPrefillGraphs:
    """The block graphs of ``prefill``'s ranks, per bucket up to ``largest`` tokens."""

    def __init__(self, prefill: ShardedPrefill) -> None:
        self.prefill = prefill
        self.largest = min(MAX_TP_BUCKET, prefill.chunk_tokens, prefill.max_len)
        self._buckets: dict[int, _Bucket] = {}
        self._pools: list[tuple[int, int] | None] = [None] * len(prefill.ranks)
        # A capture stream on each rank's device: torch.cuda.graph's default one is made once,
        # on whatever device was current then.
        self._streams = [torch.cuda.Stream(d) for d in prefill.devices]

    def run(self, tokens: torch.Tensor) -> bool:
        """Prefill ``tokens`` (int64) at positions [0, T) by replaying a bucket's graphs;
        False (nothing done) when no bucket holds T tokens."""
        t = tokens.shape[0]
        b = bucket_for(t, self.largest)
        if b is None:
            return False
        bk = self._buckets.get(b) or self._capture(b)
        padded = torch.zeros(b, dtype=torch.long)
        padded[:t] = tokens.cpu()
        sp = self.prefill
        for pf, dev, x in zip(sp.ranks, sp.devices, bk.x, strict=True):
            with torch.cuda.device(dev):
                x.copy_(pf.embed(padded.to(dev, non_blocking=True)))
        for n, per_rank in enumerate(bk.graphs):
            for dev, (attn, _) in zip(sp.devices, per_rank, strict=True):
                with torch.cuda.device(dev):
                    attn.replay()
            sp.reduce(bk.x, bk.attn, n)
            for dev, (_, mlp) in zip(sp.devices, per_rank, strict=True):
                with torch.cuda.device(dev):
                    mlp.replay()
            sp.reduce(bk.x, bk.mlp)
        return True

    def warm(self) -> int:
        """Capture every bucket not captured yet (writes K/V into cache rows no request holds
        yet: call it at load). Returns how many buckets."""
        n = 0
        for b in buckets(self.largest):
            if b not in self._buckets:
                self._capture(b)
                n += 1
        return n

    def _capture(self, bucket: int) -> _Bucket:
        sp = self.prefill
        xs, attns, mlps, ropes = [], [], [], []
        for pf, dev in zip(sp.ranks, sp.devices, strict=True):
            with torch.cuda.device(dev):
                x = torch.zeros(bucket, pf.cfg.hidden_size, device=dev)
                xs.append(x)
                attns.append(torch.zeros_like(x))
                mlps.append(torch.zeros_like(x))
                ropes.append(pf.rope(0, bucket))
        graphs = []
        for n in range(len(sp.ranks[0].p.layers)):
            per_rank = []
            for r, (pf, dev) in enumerate(zip(sp.ranks, sp.devices, strict=True)):
                x, a, m, rope = xs[r], attns[r], mlps[r], ropes[r]

                def attention(pf=pf, x=x, a=a, rope=rope, n=n) -> None:  # type: ignore[no-untyped-def]
                    a.zero_()
                    pf.attention_block(x, n, 0, rope, out=a)

                def mlp(pf=pf, x=x, m=m, n=n) -> None:  # type: ignore[no-untyped-def]
                    m.zero_()
                    pf.mlp_block(x, n, out=m)

                per_rank.append((self._graph(r, dev, attention), self._graph(r, dev, mlp)))
            graphs.append(per_rank)
        entry = _Bucket(xs, attns, mlps, ropes, graphs)
        self._buckets[bucket] = entry
        return entry

    def _graph(
        self, rank: int, dev: torch.device, block: Callable[[], None]
    ) -> torch.cuda.CUDAGraph:
        """``block`` captured on ``dev`` into the rank's pool."""
        graph, _ = capture_graph(block, dev, self._pools[rank], self._streams[rank])
        self._pools[rank] = graph.pool()
        return graph

    def captured(self) -> bool:
        return bool(self._buckets)
