"""Verify passes on the monokernel (issue 36; docs/speculative.md): one launch step computes
P positions of a request in one pass over the weights, each position exactly as a decode
step at that position computes it (kernels/csrc: the ``MK_P`` pass build).

A pass build (``KernelDims.positions`` = P) runs beside the backend's step build over the
same weights and KV cache, either teacher-forced (the tokens of every position of every
pass given, ``Params::forced``, every position's draw reported) or drafting from the
request's own tokens and keeping what the draws confirm: ``generate`` here, and the
backend's requests under ``--speculative``, greedy or sampled by temperature alone
(``Drafting``, request.py; drafted.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from monokernel.errors import InvalidRequestError
from monokernel.kernels import layout
from monokernel.runtime.backends.monokernel.kernel import DecodeKernel, Launch, Probe, wait_until
from monokernel.runtime.sampling import SamplingParams
from monokernel.runtime.speculative import SpeculationStats


class PassKernel:
    """A pass build of ``step``'s dims with ``positions`` positions a pass, over ``step``'s
    weights and cache."""

    def __init__(self, step: DecodeKernel, positions: int) -> None:
        dims = dataclasses.replace(step.dims, positions=positions)
        self.positions = positions
        self.kernel = DecodeKernel(
            step.cfg, dims, step.packed, step.cache, step.max_seq_len, step.device
        )
        # What the kernel drafts from (Params::history): position i's token, the request's
        # and then each one kept, which the kernel appends itself.
        self.history = torch.zeros(step.max_seq_len, dtype=torch.int32, device=step.device)
        # The history's leading tokens as the device holds them: a request's later launches
        # copy only what they add (load_history).
        self._held: tuple[int, ...] = ()

    def covers(self, context: int) -> bool:
        """Whether passes run at every position below ``context``: a pass has head units
        only (group units, for long context, decode by steps)."""
        return self.kernel.build.short_covers(context, self.kernel.attn_splits)

    def load_history(self, tokens: Sequence[int]) -> None:
        """The request so far into the history, on the current stream, with the kernel's
        stream waiting for it; where the history already begins with what it held
        (``held_history``), only the rest is copied."""
        k, tokens = self.kernel, tuple(tokens)
        same = len(self._held)
        if same > len(tokens) or tokens[:same] != self._held:
            same = 0
        if same < len(tokens):
            tail = torch.tensor(tokens[same:], dtype=torch.int32)
            self.history[same : len(tokens)].copy_(tail)
        self._held = tokens
        k.stream.wait_stream(torch.cuda.current_stream(k.device))

    def held_history(self, tokens: Sequence[int]) -> None:
        """After a drafting launch: the history now begins with ``tokens`` (what was loaded
        and what the kernel appended); () where that is not known."""
        self._held = tuple(tokens)

    def teacher_forced(
        self,
        start_pos: int,
        forced: Sequence[int],
        pass_len: int,
        logits: bool = True,
        timing: tuple[torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor | None, list[int], float]:
        """Passes of ``pass_len`` positions from ``start_pos``, fed ``forced`` (a whole number
        of passes; the cache holds the positions below ``start_pos``): every position's
        logits [len(forced), V] float32 (None without ``logits``: a timing run) and greedy
        token, and the seconds a pass took (CUDA events around the launch). ``timing``: the
        buffer (layout.timing_words) that pass ``timing[1]`` marks (probes.stage_profile)."""
        k = self.kernel
        n = len(forced)
        if not 1 <= pass_len <= self.positions or n % pass_len or n == 0:
            raise InvalidRequestError(
                f"{n} forced tokens in passes of {pass_len}: whole passes of 1 to "
                f"{self.positions} positions needed"
            )
        if not 0 <= start_pos <= k.max_seq_len - n:
            raise InvalidRequestError(
                f"{n} positions from {start_pos} do not fit the cache of {k.max_seq_len}"
            )
        dev = k.device
        ids = torch.tensor(list(forced), dtype=torch.int32, device=dev)  # [n]
        out = torch.full((n, k.cfg.vocab_size), float("nan"), device=dev) if logits else None
        greedy = SamplingParams(temperature=0.0, max_tokens=n)
        k.make_current()
        with torch.cuda.device(dev):
            k.prepare(())
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            launch = Launch(int(forced[0]), start_pos, n // pass_len, greedy, pass_len=pass_len)
            probe = Probe(forced=ids, debug_logits=out)
            if timing is not None:
                probe = Probe(forced=ids, debug_logits=out, timing=timing[0], timing_step=timing[1])
            k.start(launch, probe, (begin, end))
            wait_until(end.query, "a verify pass")
        words = k.token_words
        ran = int(words[0])
        if ran != n:
            raise RuntimeError(f"the pass build reported {ran} of {n} positions")
        tokens = [int(words[2 + i]) - 1 for i in range(n)]
        return out, tokens, begin.elapsed_time(end) * 1e-3 * pass_len / n

    def generate(
        self,
        tokens: Sequence[int],
        n: int,
        ngram: tuple[int, int] = (2, 4),
        stop_ids: Sequence[int] = (),
    ) -> tuple[list[int], int, int]:
        """Greedy decoding with drafts from the request's own tokens, verified in passes:
        ``tokens`` are the request so far (the cache holds all but the last, which is the
        first pass's input), ``n`` the tokens to draw at most. Returns the tokens drawn (as
        decoding step by step draws them), and the drafted and accepted counts."""
        k = self.kernel
        start = len(tokens) - 1
        if not 0 <= start < k.max_seq_len - 1 or n < 1 or start + n > k.max_seq_len:
            raise InvalidRequestError(
                f"{n} tokens after {len(tokens)} do not fit the cache of {k.max_seq_len}"
            )
        greedy = SamplingParams(temperature=0.0, max_tokens=n)
        k.make_current()
        with torch.cuda.device(k.device):
            k.prepare(stop_ids)
            self.load_history(tokens)
            launch = Launch(
                int(tokens[-1]), start, n, greedy, n_stop=len(stop_ids),
                pass_len=self.positions, history=self.history.data_ptr(), ngram=ngram,
            )  # fmt: skip
            k.start(launch)
            wait_until(k.finished, "verify passes")
            counts = draft_counts(k)
        words = k.token_words
        ran = int(words[0])
        return [int(words[2 + i]) - 1 for i in range(ran)], counts.drafted, counts.accepted

    def close(self) -> None:
        self.kernel.close()


def drawn_in_passes(sampling: SamplingParams, vocab_size: int) -> bool:
    """Whether a pass build draws ``sampling``'s tokens as the step build does: greedy, or
    by temperature alone (the seeded Gumbel-max draw of each position's own key), not top-k,
    top-p or min_p, whose draws need the whole distribution (a step's grid-wide draw)."""
    if sampling.greedy:
        return True
    whole_vocab = sampling.top_k <= 0 or sampling.top_k >= vocab_size
    return whole_vocab and sampling.top_p >= 1.0 and sampling.min_p == 0.0


def draft_counts(kernel: DecodeKernel) -> SpeculationStats:
    """What a finished drafting launch of ``kernel`` counted (kernels/layout.py FLAGS)."""
    flags = dict(zip((name for name, _ in layout.FLAGS), kernel.flags.tolist(), strict=False))
    return SpeculationStats(flags["verified"], flags["drafted"], flags["accepted"])


@dataclass(frozen=True, slots=True)
class Drafting:
    """A request's launch on a pass build that drafts (RequestDriver.run): the build, the
    n-gram bounds (shortest, longest suffix matched) and where its counts go."""

    passes: PassKernel
    ngram: tuple[int, int]
    stats: SpeculationStats
