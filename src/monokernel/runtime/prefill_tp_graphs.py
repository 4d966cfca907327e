"""CUDA graphs of the tensor-parallel prefill (runtime/prefill_tp.py) for a fresh prompt.

Eager, a TP=2 prefill of the Qwen2.5-Coder-1.5B shape is ~2,000 torch and Triton calls: ~33 ms
of host time whatever the prompt's length, against 3.5 ms for the one-GPU prefill's graph.
The ranks exchange partial sums twice a layer, and that exchange is a kernel on each rank
that waits for its peers on the GPU (prefill_exchange.py), so each rank's whole prefill (the
embedding, every block and every exchange) is one graph: a prompt costs the host one token
copy and one replay a rank. The replays run at once on their GPUs and meet at each exchange.

As in prefill_graphs.py, a prompt prefilled from position 0 pads to a bucket (powers of two
from 16 up to the chunk or the cache length, whichever is smaller) with token 0 after the
real tokens, whose K/V land in cache rows no request reads before the decode kernel
overwrites them. The buckets' graphs of a rank read their tokens from and keep the residual
in one pair of buffers of the largest bucket's size, and share one memory pool: one prefill
runs at a time. The partials are the exchange's. Prompts past the chunk run eagerly. A bucket
is captured after one eager prefill of its size on every rank (nothing first-time during
capture; the ranks' exchanges need each other, so no rank can warm up alone); ``warm``
captures every bucket at load (MONOKERNEL_PREFILL_WARMUP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from monokernel.models.config import ModelConfig
from monokernel.runtime.prefill import workspace_bytes
from monokernel.runtime.prefill_exchange import ATTENTION, MLP
from monokernel.runtime.prefill_graphs import bucket_for, buckets
from monokernel.weights.formats import DEFAULT_FORMAT

if TYPE_CHECKING:
    from monokernel.runtime.prefill_qkv import ChunkRope
    from monokernel.runtime.prefill_tp import ShardedPrefill


def graph_bytes(
    rank: ModelConfig, chunk_tokens: int, max_len: int, precision: str, fmt: str = DEFAULT_FORMAT
) -> int:
    """One rank's memory for its graphs: the tokens (int64) and the residual [largest, H]
    fp32, every bucket's RoPE positions and factors, and the pool the largest bucket's
    prefill runs in (as eager's workspace, its layers in the weight format ``fmt``)."""
    largest = min(chunk_tokens, max_len)
    if largest < 1:
        return 0
    statics = (4 * rank.hidden_size + 8) * largest + (8 + 8 * rank.head_dim) * sum(buckets(largest))
    return statics + workspace_bytes(rank, largest, largest, precision, fmt)


@dataclass(slots=True)
class _Bucket:
    ropes: list[ChunkRope]  # per rank: positions [0, bucket), which its graph reads
    graphs: list[torch.cuda.CUDAGraph]  # per rank: its whole prefill


class ShardedPrefillGraphs:
    """The prefill graphs of ``prefill``'s ranks, per bucket up to ``largest`` tokens."""

    def __init__(self, prefill: ShardedPrefill) -> None:
        if prefill.exchange is None:
            raise ValueError("prefill graphs need the GPUs' exchange (prefill_exchange.py)")
        self.prefill = prefill
        self.largest = min(prefill.chunk_tokens, prefill.max_len)
        self._buckets: dict[int, _Bucket] = {}
        # Per rank: [largest] int64, the replay's input; [largest, H] fp32, the residual. A
        # bucket's graphs use their first rows.
        devices, rows = prefill.devices, self.largest
        self._tokens = [torch.zeros(rows, dtype=torch.long, device=d) for d in devices]
        self._x = [torch.zeros(rows, prefill.hidden, device=d) for d in devices]
        self._pools: list[tuple[int, int] | None] = [None] * len(prefill.ranks)
        # A capture stream on each rank's device: torch.cuda.graph's default one is made once,
        # on whatever device was current then.
        self._streams = [torch.cuda.Stream(d) for d in prefill.devices]

    def run(self, tokens: torch.Tensor) -> list[torch.Tensor] | None:
        """Prefill ``tokens`` (int64) at positions [0, T) by replaying a bucket's graphs:
        every rank's residual [T, H] afterwards (valid until the next replay); None (nothing
        done) when no bucket holds T tokens."""
        t = tokens.shape[0]
        b = bucket_for(t, self.largest)
        if b is None:
            return None
        bk = self._buckets.get(b) or self._capture(b)
        padded = torch.zeros(b, dtype=torch.long)
        padded[:t] = tokens.cpu()
        for dev, tok, graph in zip(self.prefill.devices, self._tokens, bk.graphs, strict=True):
            with torch.cuda.device(dev):
                tok[:b].copy_(padded)
                graph.replay()
        return [x[:t] for x in self._x]

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
        sp.chunk(torch.zeros(bucket, dtype=torch.long), 0)  # the warm-up, every rank at once
        for dev in sp.devices:
            torch.cuda.synchronize(dev)
        ropes, graphs = [], []
        for r, (pf, dev) in enumerate(zip(sp.ranks, sp.devices, strict=True)):
            with torch.cuda.device(dev):
                tok, x = self._tokens[r][:bucket], self._x[r][:bucket]
                rope = pf.rope(0, bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pools[r], stream=self._streams[r]):
                    x.copy_(pf.embed(tok))
                    for n in range(len(pf.p.layers)):
                        for which in (ATTENTION, MLP):
                            sp.block(r, which, x, n, 0, rope)
                            sp.exchange.reduce_rank(r, x, which, sp.bias(r, which, n))
            self._pools[r] = graph.pool()
            ropes.append(rope)
            graphs.append(graph)
        entry = _Bucket(ropes, graphs)
        self._buckets[bucket] = entry
        return entry

    def captured(self) -> bool:
        return bool(self._buckets)
