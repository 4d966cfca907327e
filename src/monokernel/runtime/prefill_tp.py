"""Tensor-parallel prefill: each rank runs the prompt through its own shard and writes its own
KV heads, so no GPU ever holds the whole model and the prompt's work splits N ways.

A rank's ``Prefiller`` (runtime/prefill.py) runs over the rank's repacked shard
(weights/shard.py: its query and KV heads, its gate/up rows, its columns of O and down) and
its own cache. Per layer the two projections that end in the residual stream give partial
sums; every rank adds the N partials to its residual one by one in rank order 0..N-1, so
every rank holds the same bits of the residual (as the decode kernels' all-reduce does,
kernels/csrc/tp.cuh), then the O bias once. The partials travel between GPUs as ordinary
device-to-device copies, which order themselves against both devices' streams: the host
issues everything without waiting.

Per layer and rank the extra memory is the partial and one copy of each peer's, [T, H] fp32
each (``extra_bytes``). A prompt from position 0 of up to 2,048 tokens replays each rank's
blocks as CUDA graphs between the exchanges (prefill_tp_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from monokernel.runtime.prefill import Prefiller, checked_tokens
from monokernel.runtime.prefill_graphs import graphs_enabled
from monokernel.runtime.prefill_tp_graphs import ShardedPrefillGraphs


def _on(device: torch.device) -> AbstractContextManager[object]:
    """The device guard Triton launches need (they use the current device); none on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class ShardedPrefill:
    """The ranks' prefillers (rank r's first), run layer by layer in lock step."""

    def __init__(self, ranks: Sequence[Prefiller], graphs: bool | None = None) -> None:
        """``graphs``: replay block graphs for prompts from position 0
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
        if graphs is None:
            graphs = all(graphs_enabled(d) for d in self.devices)
        self.graphs = ShardedPrefillGraphs(self) if graphs else None

    @staticmethod
    def extra_bytes(chunk_tokens: int, hidden: int, tp: int) -> int:
        """A rank's transient memory beyond its own prefill's: its partial and the peers'."""
        return chunk_tokens * hidden * 4 * (1 + max(tp - 1, 0))

    @torch.no_grad()
    def run(self, tokens: Sequence[int] | torch.Tensor, start: int) -> None:
        """Prefill ``tokens`` at positions [start, start + T) into every rank's cache
        (positions [0, start) must already hold the prefix there). Asynchronous."""
        tokens = checked_tokens(tokens, start, self.max_len)
        if start == 0 and self.graphs is not None and self.graphs.run(tokens):
            return
        for a in range(0, tokens.shape[0], self.chunk_tokens):
            self._chunk(tokens[a : a + self.chunk_tokens], start + a)

    def _chunk(self, tokens: torch.Tensor, start: int) -> None:
        end = start + tokens.shape[0]
        xs, ropes = [], []
        for pf, dev in zip(self.ranks, self.devices, strict=True):
            with _on(dev):
                ropes.append(pf.rope(start, end))
                xs.append(pf.embed(tokens.to(dev)))  # [T, H] fp32, the same on every rank
        for n in range(len(self.ranks[0].p.layers)):
            parts = []
            for pf, dev, x, rope in zip(self.ranks, self.devices, xs, ropes, strict=True):
                with _on(dev):
                    out = torch.zeros_like(x)
                    pf.attention_block(x, n, start, rope, out=out)
                    parts.append(out)
            self.reduce(xs, parts, n)
            parts = []
            for pf, dev, x in zip(self.ranks, self.devices, xs, strict=True):
                with _on(dev):
                    out = torch.zeros_like(x)
                    pf.mlp_block(x, n, out=out)
                    parts.append(out)
            self.reduce(xs, parts)

    def reduce(self, xs: list[torch.Tensor], parts: list[torch.Tensor], bias_of: int = -1) -> None:
        """xs[r] += parts[0], += parts[1], ... += parts[N-1] in that order on every rank, then
        layer ``bias_of``'s O bias (each rank holds its copy)."""
        for r, (pf, x, dev) in enumerate(zip(self.ranks, xs, self.devices, strict=True)):
            with _on(dev):
                for q, part in enumerate(parts):
                    x += part if q == r else part.to(dev)
                bias = pf.p.layers[bias_of].bo if bias_of >= 0 else None
                if bias is not None:
                    x += bias
