"""Tensor-parallel prefill: each rank runs the prompt through its own shard and writes its own
KV heads, so no GPU ever holds the whole model and the prompt's work splits N ways.

A rank's ``Prefiller`` (runtime/prefill.py) runs over the rank's repacked shard
(weights/shard.py: its query and KV heads, its gate/up rows, its columns of O and down) and
its own cache. Per layer the two projections that end in the residual stream give partial
sums; every rank adds the N partials to its residual one by one in rank order 0..N-1, so
every rank holds the same bits of the residual (as the decode kernels' all-reduce does,
kernels/csrc/tp.cuh), then the O bias once.

On GPUs the partials stay where they were written and a small kernel on each rank sums
them from its peers' memory (prefill_exchange.py), so nothing in a layer goes through the
host and a prompt from position 0 in one chunk replays one CUDA graph a rank
(prefill_tp_graphs.py). On the CPU (the tests' ranks) the host adds copies of the partials.
Per rank the extra memory is the two partial buffers, [chunk, H] fp32 each
(prefill_exchange.exchange_bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from monokernel.runtime.prefill import Prefiller, checked_tokens
from monokernel.runtime.prefill_exchange import ATTENTION, MLP, PeerExchange
from monokernel.runtime.prefill_graphs import graphs_enabled
from monokernel.runtime.prefill_tp_graphs import ShardedPrefillGraphs

if TYPE_CHECKING:
    from monokernel.runtime.prefill_qkv import ChunkRope


def _on(device: torch.device) -> AbstractContextManager[object]:
    """The device guard Triton launches need (they use the current device); none on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class ShardedPrefill:
    """The ranks' prefillers (rank r's first), run layer by layer in lock step."""

    def __init__(self, ranks: Sequence[Prefiller], graphs: bool | None = None) -> None:
        """``graphs``: replay one graph a rank for prompts from position 0
        (prefill_tp_graphs.py); default: on CUDA unless MONOKERNEL_PREFILL_GRAPHS=0."""
        if not ranks:
            raise ValueError("a sharded prefill needs at least one rank")
        chunks = {pf.chunk_tokens for pf in ranks}
        if len(chunks) != 1:
            raise ValueError(f"the ranks' prefill chunks differ: {sorted(chunks)}")
        self.ranks = list(ranks)
        self.chunk_tokens = chunks.pop()
        self.max_len = ranks[0].max_len
        self.devices = [pf.k.device for pf in ranks]
        self.hidden = ranks[0].cfg.hidden_size
        on_gpus = all(d.type == "cuda" for d in self.devices)
        rows = min(self.chunk_tokens, self.max_len)
        self.exchange = PeerExchange(self.devices, rows, self.hidden) if on_gpus else None
        if graphs is None:
            graphs = all(graphs_enabled(d) for d in self.devices)
        self.graphs = ShardedPrefillGraphs(self) if graphs and on_gpus else None

    @torch.no_grad()
    def run(
        self, tokens: Sequence[int] | torch.Tensor, start: int, logits: bool = False
    ) -> torch.Tensor | None:
        """Prefill ``tokens`` at positions [start, start + T) into every rank's cache
        (positions [0, start) must already hold the prefix there); with ``logits``, the last
        token's logits [V] float32 on rank 0's device: each rank's LM-head rows (its
        vocabulary range, in rank order) over the residual every rank holds. Asynchronous."""
        tokens = checked_tokens(tokens, start, self.max_len)
        xs = None
        if start == 0 and self.graphs is not None:
            xs = self.graphs.run(tokens)
        if xs is None:
            for a in range(0, tokens.shape[0], self.chunk_tokens):
                xs = self.chunk(tokens[a : a + self.chunk_tokens], start + a)
        if not logits:
            return None
        assert xs is not None
        parts = []
        for pf, dev, x in zip(self.ranks, self.devices, xs, strict=True):
            with _on(dev):
                parts.append(pf.lm_head_logits(x[-1:])[0].to(self.devices[0]))
        return torch.cat(parts)

    def chunk(self, tokens: torch.Tensor, start: int) -> list[torch.Tensor]:
        """One chunk, eagerly: layer by layer, each block on every rank, then its exchange
        on every rank; every rank's residual [T, H] afterwards. A block that raises (out of
        memory) does so before any rank's exchange of it is issued, so no rank is left
        waiting on the GPU for a peer that never comes (the exchange would trap after
        TIMEOUT_MS, losing the context)."""
        end = start + tokens.shape[0]
        xs, ropes = [], []
        for pf, dev in zip(self.ranks, self.devices, strict=True):
            with _on(dev):
                ropes.append(pf.rope(start, end))
                xs.append(pf.embed(tokens.to(dev)))  # [T, H] fp32, the same on every rank
        for n in range(len(self.ranks[0].p.layers)):
            for which in (ATTENTION, MLP):
                parts = []
                for r, (dev, x, rope) in enumerate(zip(self.devices, xs, ropes, strict=True)):
                    with _on(dev):
                        parts.append(self.block(r, which, x, n, start, rope))
                self.reduce(xs, parts, which, n)
        return xs

    def block(
        self, r: int, which: int, x: torch.Tensor, n: int, start: int, rope: ChunkRope
    ) -> torch.Tensor:
        """Rank r's ``which`` block (ATTENTION or MLP) of layer n on its residual x [T, H]:
        its partial sum (x unchanged), in the exchange's buffer on GPUs."""
        pf = self.ranks[r]
        if self.exchange is None:
            part = torch.zeros_like(x)
        else:
            part = self.exchange.partial(r, which, x.shape[0])
            part.zero_()
        if which == ATTENTION:
            pf.attention_block(x, n, start, rope, out=part)
        else:
            pf.mlp_block(x, n, out=part)
        return part

    def bias(self, r: int, which: int, n: int) -> torch.Tensor | None:
        """What the exchange adds after the partials: layer n's O bias after attention."""
        return self.ranks[r].p.layers[n].bo if which == ATTENTION else None

    def reduce(self, xs: list[torch.Tensor], parts: list[torch.Tensor], which: int, n: int) -> None:
        """xs[r] += parts[0], += parts[1], ... += parts[N-1] in that order on every rank, then
        the block's bias (each rank holds its copy)."""
        for r, (x, dev) in enumerate(zip(xs, self.devices, strict=True)):
            with _on(dev):
                if self.exchange is not None:
                    self.exchange.reduce_rank(r, x, which, self.bias(r, which, n))
                    continue
                for q, part in enumerate(parts):
                    x += part if q == r else part.to(dev)
                bias = self.bias(r, which, n)
                if bias is not None:
                    x += bias

    def close(self) -> None:
        """Free the exchange's device memory (the graphs first: they use it)."""
        self.graphs = None
        if self.exchange is not None:
            self.exchange.free()
            self.exchange = None
