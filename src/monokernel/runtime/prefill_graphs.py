"""CUDA graphs of the prefill for a fresh prompt: TTFT without the Python launch overhead.

An eager prefill chunk is ~35 small launches per layer (norms, the split QKV GEMM, RoPE,
cache writes, GQA expansion, attention, the MLP): ~600 for the Llama-3.2-1B shape, which
the host needs ~15 ms to issue while the GPU needs ~3 ms for a 1,024-token prompt. So a
prompt prefilled from position 0 in one chunk replays a graph captured for a bucket of
token counts (powers of two from 16 up to the chunk size, and the chunk or the cache length
itself where that is smaller than the next power): the tokens are padded to the bucket with
token 0. Padding sits *after* the real tokens, so causal attention keeps it out
of every real token's result; its K/V land in cache positions the request never reads
before the decode kernel overwrites them (the kernel writes position n-1+s before step s
attends), and the prefix cache never counts them as held.

A suffix prefilled after a reused prefix (an agent's next turn, at most MAX_SUFFIX_BUCKET
tokens) replays a second kind of graph: positions are a device tensor (RoPE rows and cache
rows by index), and attention takes its key count from them on the device (flash attention
on the cache, prefill.flash_cache_attention; where that is missing, a fixed power-of-two
number of cache rows under a mask built from the positions), so one graph serves every start
up to that many rows. Later
chunks of a prompt longer than the chunk stay eager (GPU-bound at that size anyway).

Every graph a request can replay is captured up front (``warm``: the monokernel does at
load, ``MONOKERNEL_PREFILL_WARMUP``): a fresh prompt's buckets, and each suffix bucket at
each power-of-two number of key rows (``graph_keys``: 42 graphs for an 8,192-token cache), so
no request pays a capture (about two eager prefills of that size) nor the first-use compile
of the Triton kernels inside. A graph not captured yet (the warm-up off) is captured the
first time it is needed. All share one memory pool: they never run at once.
``MONOKERNEL_PREFILL_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from monokernel import envs

MIN_BUCKET = 16
T = TypeVar("T")


def graphs_enabled(device: torch.device) -> bool:
    return device.type == "cuda" and bool(envs.MONOKERNEL_PREFILL_GRAPHS)


def bucket_for(tokens: int, largest: int) -> int | None:
    """The smallest power of two >= tokens (at least MIN_BUCKET), or ``largest`` itself where
    that power passes it (a cache of 4,016 positions graphs a 4,000-token prompt too); None
    above ``largest``."""
    if tokens < 1 or tokens > largest:
        return None
    b = MIN_BUCKET
    while b < tokens:
        b *= 2
    return min(b, largest)


def buckets(largest: int) -> list[int]:
    """Every bucket bucket_for gives under ``largest``, smallest first."""
    out, b = [], MIN_BUCKET
    while b < largest:
        out.append(b)
        b *= 2
    return [*out, largest] if largest >= 1 else out


# A suffix prefilled after a reused prefix (an agent's next turn) gets graphs too, up to this
# many tokens: its attention reads a fixed number of cache rows under a mask built from the
# positions on the device. Larger suffixes are GPU-bound anyway, and their mask would be big.
MAX_SUFFIX_BUCKET = 1024


def keys_bucket(end: int, max_len: int) -> int:
    """Cache rows a graph at a later start reads: the power of two >= end, capped at the
    cache length, so an agent's growing conversation needs a new graph only now and then."""
    b = MIN_BUCKET
    while b < end:
        b *= 2
    return min(b, max_len)


def graph_keys(largest: int, max_len: int) -> list[tuple[int, int]]:
    """Every (bucket, key rows or 0) graph ``PrefillGraphs.run`` can ask for: a fresh
    prompt's buckets up to ``largest`` (0 key rows), then each suffix bucket's key-row
    buckets for every start it can have (start >= 1, start + bucket <= max_len)."""
    out = [(b, 0) for b in buckets(largest)]
    for b in buckets(min(largest, MAX_SUFFIX_BUCKET)):
        end = b + 1  # the smallest end: start 1
        while end <= max_len:
            k = keys_bucket(end, max_len)
            out.append((b, k))
            end = k + 1  # the next end with a larger bucket
    return out


def capture_graph(
    fn: Callable[[], T],
    device: torch.device,
    pool: tuple[int, int] | None,
    stream: torch.cuda.Stream,
) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn`` captured on ``stream`` (on ``device``) into ``pool``, after one eager run on a
    side stream so that nothing is first-time during capture (cuBLAS handles and
    workspaces, the attention kernel's choice, Triton's first compile); the graph and what
    the captured call returned (its static outputs)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
    return graph, out


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bucket] int64, the replay's input
    pos: torch.Tensor | None  # [bucket] int64 positions (graphs at a later start)
    x: torch.Tensor  # [bucket, hidden] fp32, its residual stream out


class PrefillGraphs:
    """``chunk(tokens) -> x``: the eager forward of one chunk at position 0 (writes K/V);
    ``chunk_at(tokens, pos, keys) -> x``: the same at device positions ``pos`` reading cache
    rows [0, keys); ``largest``: the largest bucket (the chunk size, capped by the cache)."""

    def __init__(
        self,
        chunk: Callable[[torch.Tensor], torch.Tensor],
        chunk_at: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
        largest: int,
        max_len: int,
    ) -> None:
        self._chunk, self._chunk_at = chunk, chunk_at
        self.largest, self.max_len = largest, max_len
        self._graphs: dict[tuple[int, int], _Graph] = {}  # (bucket, keys or 0) -> graph
        self._pool: tuple[int, int] | None = None
        # Its own capture stream, on the device of the first capture: torch.cuda.graph's
        # default one is made once per process, on whatever device was current then.
        self._stream: torch.cuda.Stream | None = None

    def run(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor | None:
        """The residual stream [T, hidden] of ``tokens`` (int64 on the device) prefilled at
        positions [start, start + T), or None when no graph fits (the caller runs it
        eagerly). The result is a view of the graph's static output: valid until the next
        replay."""
        t = tokens.shape[0]
        b = bucket_for(t, self.largest if start == 0 else min(self.largest, MAX_SUFFIX_BUCKET))
        if b is None or start + b > self.max_len:  # padding must stay inside the cache
            return None
        key = (b, 0 if start == 0 else keys_bucket(start + b, self.max_len))
        g = self._graphs.get(key) or self._capture(*key)
        g.tokens[:t].copy_(tokens)
        g.tokens[t:].zero_()
        if g.pos is not None:
            torch.arange(start, start + b, device=g.pos.device, out=g.pos)
        g.graph.replay()
        return g.x[:t]

    def fitting_start(self, start: int, tokens: int) -> int:
        """Where to prefill ``tokens`` tokens meant for [start, start + tokens) so that a graph
        runs them: ``start`` itself, or, where the bucket's padding would pass the cache's
        end (a turn near the end of the context), an earlier start whose bucket ends at the
        cache's end: the caller prefills the held tokens in between again (the same K/V)
        instead of the turn running eagerly, which cost up to a second the first time."""
        cap = self.largest if start == 0 else min(self.largest, MAX_SUFFIX_BUCKET)
        b = bucket_for(tokens, cap)
        if b is None or start + b <= self.max_len:
            return start
        return max(0, self.max_len - b)

    def _capture(self, bucket: int, keys: int) -> _Graph:
        device = torch.device("cuda", torch.cuda.current_device())
        tokens = torch.zeros(bucket, dtype=torch.long, device=device)
        pos = None
        if keys:  # positions [keys - bucket, keys) while capturing: inside the cache
            pos = torch.arange(keys - bucket, keys, dtype=torch.long, device=device)

        def forward() -> torch.Tensor:
            return self._chunk(tokens) if pos is None else self._chunk_at(tokens, pos, keys)

        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        graph, x = capture_graph(forward, device, self._pool, self._stream)
        self._pool = graph.pool()
        entry = _Graph(graph, tokens, pos, x)
        self._graphs[(bucket, keys)] = entry
        return entry

    def warm(self) -> int:
        """Capture every graph a request can replay (graph_keys: each fresh prompt's bucket,
        each suffix bucket at each key-row bucket) not captured yet, on the current device;
        writes K/V into cache rows no request holds yet (call it at load). Returns how many."""
        n = 0
        for key in graph_keys(self.largest, self.max_len):
            if key not in self._graphs:
                self._capture(*key)
                n += 1
        return n

    def captured(self) -> bool:
        """Whether any graph holds the addresses of what it ran on."""
        return bool(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._pool = None
