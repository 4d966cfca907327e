"""One request through the kernel: the prompt checks, the prefill hand-off, the first token,
then the tokens the kernel publishes, streamed until a stop, the budget or a cancel.

The prefill's last logits give the first token (FIRST_TOKEN_SOURCES); the kernel then starts
from it and produces the rest by itself; each lands in pinned host-mapped memory where the
driver picks it up and yields it while the kernel goes on. A host-mapped cancel word (raised
when the CancelToken is set or the iterator is closed) stops it within a token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence

import torch

from monokernel import envs
from monokernel.errors import EngineFailedError, InvalidRequestError
from monokernel.runtime.backends.base import CancelToken
from monokernel.runtime.backends.monokernel.grammar_mask import GrammarMask
from monokernel.runtime.backends.monokernel.kernel import (
    MAX_STOP_IDS,
    NO_PROBE,
    STOP_GRACE_SECONDS,
    DecodeKernel,
    KernelStuckError,
    Launch,
    Probe,
    stall_seconds,
)
from monokernel.runtime.backends.monokernel.kv import KVStore
from monokernel.runtime.backends.monokernel.logit_rules import LogitRules
from monokernel.runtime.backends.monokernel.token_reader import read_tokens
from monokernel.runtime.backends.monokernel.verify_pass import Drafting, draft_counts
from monokernel.runtime.constrained import TokenMatcher
from monokernel.runtime.logprobs import TokenLogprobs, token_logprobs
from monokernel.runtime.prefix_cache import ReusePlan, fed_tokens
from monokernel.runtime.sampling import SamplingParams, check_bias_ids, penalize, sample

# Where a request's first token comes from. "prefill": the prompt's last logits, computed by
# the prefill that fills the cache anyway (one LM-head GEMV); the kernel then starts at the
# next position, so time to first token loses one whole decode step. "kernel": the kernel's
# first step computes the last prompt position and draws it (as the debug paths always do).
FIRST_TOKEN_SOURCES: tuple[str, ...] = ("prefill", "kernel")


def prefill_gives_first(first_token: str | None) -> bool:
    """Whether a backend takes the first token from the prefill: ``first_token`` or else
    MONOKERNEL_FIRST_TOKEN, refused (InvalidRequestError) unless one of FIRST_TOKEN_SOURCES."""
    source = first_token or envs.MONOKERNEL_FIRST_TOKEN
    if source not in FIRST_TOKEN_SOURCES:
        raise InvalidRequestError(
            f"first token source {source!r}; choose from {', '.join(FIRST_TOKEN_SOURCES)}"
        )
    return source == "prefill"


def check_seeded(sampling: SamplingParams) -> None:
    """Refuse a sampled request without a fixed seed before any work for it (the kernel's
    draws are keyed by the seed)."""
    if not sampling.greedy and sampling.seed is None:
        raise InvalidRequestError("sampling needs a fixed seed (SamplingParams.with_seed)")


# The requests a backend runs at load (MONOKERNEL_PREFILL_WARMUP): greedy, and a draw from the
# whole vocabulary, so the first real request meets no first use of either path.
WARMUP_SAMPLING = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.9, seed=0),
)


def ids_in_vocab(ids: Sequence[int], vocab_size: int) -> bool:
    """Whether every id is in [0, vocab_size): min and max run in C, a Python loop over a
    16k-token prompt does not."""
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def checked_steps(
    prompt_ids: Sequence[int],
    stop_ids: Sequence[int],
    max_new_tokens: int,
    max_seq_len: int,
    vocab_size: int,
    known_valid: int = 0,
) -> int:
    """Refuse a request one launch cannot take (InvalidRequestError); else the decode steps
    it runs: the input of step s sits at position len(prompt)-1+s, inside the cache.
    ``known_valid``: leading token ids already checked (the live cache's tokens that the
    prompt repeats): an agent's 16k-token turn is then not a 16k-step Python loop (~1-2 ms,
    all of it inside the time to first token)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt must hold at least one token")
    if n > max_seq_len:
        raise InvalidRequestError(f"the prompt ({n} tokens) exceeds max_seq_len={max_seq_len}")
    if not ids_in_vocab(prompt_ids[known_valid:] if known_valid else prompt_ids, vocab_size):
        raise InvalidRequestError("a prompt token id is outside the vocabulary")
    if len(stop_ids) > MAX_STOP_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_IDS} stop token ids are supported")
    return min(max_new_tokens, max_seq_len - n + 1)


class RequestDriver:
    """Runs requests on ``kernel`` over the cache of ``kv``."""

    def __init__(self, kernel: DecodeKernel, kv: KVStore) -> None:
        self.kernel, self.kv = kernel, kv
        self.max_seq_len, self.vocab_size = kernel.max_seq_len, kernel.cfg.vocab_size
        self.device = kernel.device
        # Why this driver can run no more requests (a kernel that faulted, or stalled and
        # would not stop: the GPU stays busy with it until the process exits); None: healthy.
        self.failure: str | None = None

    def run(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_ids: Sequence[int],
        cancel: CancelToken | None,
        probe: Probe = NO_PROBE,
        forced_ids: Sequence[int] | None = None,
        first_from_prefill: bool = False,
        matcher: TokenMatcher | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        drafting: Drafting | None = None,
        continued: bool = False,
        handback: Callable[[int], bool] | None = None,
    ) -> Generator[int, None, None]:
        """The generated ids of one launch. ``probe``: a debug or profiling launch's extra
        inputs; ``forced_ids``: the host copy of ``probe.forced``, so the prefix bookkeeping
        knows which tokens the kernel's steps wrote into the cache. ``first_from_prefill``:
        the prefill covers the whole prompt and its last logits give the first token (sampled
        on the host side by the same rule, runtime/sampling.py); the kernel starts one
        position later from that token. Else the kernel's first step computes the last prompt
        position and draws the first token itself (the debug and profiling paths, whose step
        numbers and logits are the kernel's). ``matcher``: a constrained request's grammar
        (runtime/constrained.py): the first token is drawn from the masked prefill logits,
        and each kernel step's mask reaches the kernel while it runs the step before
        (grammar_mask.py). The penalties, min_p and logit_bias apply in the kernel
        (logit_rules.py); with ``sampling.logprobs`` set, each token's TokenLogprobs is
        appended to ``logprobs`` before the token is yielded. ``drafting``: a
        request's launch on a pass build that drafts from the request's own tokens and keeps
        what its draws confirm (verify_pass.py), until a pass has no draft or keeps none of
        it; its counts land in ``drafting.stats``. ``continued``: the cache holds positions
        [0, len(prompt_ids) - 1) of ``prompt_ids`` (the launch before left them): no prefix
        lookup, no prefill. ``handback(token)``, called as each token lands: True stops the
        kernel after the step it is running, whose tokens are yielded too (drafted.py)."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        prefix = self.kv.prefix
        kernel = self.kernel if drafting is None else drafting.passes.kernel
        n = len(prompt_ids)
        # What the cache already holds of the prompt (live cache or snapshot) is checked ids
        # and in-vocabulary outputs: only the rest needs checking. The fill follows this plan.
        plan = ReusePlan(n - 1) if continued else prefix.plan(prompt_ids)
        n_steps = checked_steps(
            prompt_ids, stop_ids, max_new_tokens, self.max_seq_len, self.vocab_size, plan.reuse
        )
        check_seeded(sampling)
        check_bias_ids(sampling, self.vocab_size)
        kernel.make_current()
        first: int | None = None
        want_logprobs = logprobs is not None and sampling.logprobs is not None
        first_logprobs: TokenLogprobs | None = None
        with torch.cuda.device(self.device):
            if first_from_prefill:
                logits = self.kv.filler.fill(prompt_ids, n, logits=True, plan=plan)
                assert logits is not None
            else:
                # Positions [0, n-1); the kernel's first step computes position n-1 itself.
                self.kv.filler.fill(prompt_ids, n - 1, plan=plan)
            # The launch's setup is queued behind the prefill before the host waits for the
            # first token, so only the launch itself sits between that token and the kernel.
            kernel.prepare(stop_ids)
            if first_from_prefill:
                first, first_logprobs = prefill_first_token(
                    logits, sampling, prompt_ids, matcher, want_logprobs
                )
            rules = kernel.rules.fields(sampling, prompt_ids, () if first is None else (first,))
            if LogitRules.filled(rules):  # the buffers' fill goes before the launch too
                kernel.stream.wait_stream(torch.cuda.current_stream(self.device))
        # Positions the cache holds before the kernel's first step, and that step's input.
        held, step_in = n - 1, prompt_ids[-1]
        if first is not None:
            held, step_in = n, first
            n_steps -= 1
            if first in stop_ids:
                n_steps = 0
        launched = n_steps > 0
        out = kernel.token_words
        mask_tag = 0
        if launched and matcher is not None:
            mask_tag = begin_masks((kernel.grammar,), matcher, n_steps)
        if launched:
            launch = Launch(step_in, held, n_steps, sampling, len(stop_ids), mask_tag, rules)
            if drafting is not None:
                with torch.cuda.device(self.device):
                    drafting.passes.load_history((*prompt_ids[:held], step_in))
                launch = dataclasses.replace(
                    launch,
                    pass_len=drafting.passes.positions,
                    history=drafting.passes.history.data_ptr(),
                    ngram=drafting.ngram,
                    draft_exit=True,
                )
            kernel.start(launch, probe)
        finished = failed = False

        def check(stalled_s: float) -> None:
            try:
                done = kernel.finished()  # raises on a kernel fault
            except RuntimeError as e:
                raise KernelStuckError(f"the monokernel faulted: {e}") from e
            if done and not out[1]:
                raise KernelStuckError("the monokernel exited without finishing")
            if stalled_s > stall_seconds():
                raise KernelStuckError(
                    f"the monokernel produced no token for {stall_seconds():.0f} s "
                    "(MONOKERNEL_STALL_SECONDS)"
                )

        try:
            if first is not None and not (cancel is not None and cancel.is_set()):
                if first_logprobs is not None and logprobs is not None:
                    logprobs.append(first_logprobs)
                if handback is not None and handback(first) and launched:
                    kernel.cancel()
                yield first  # the kernel is already running on the next one
            if launched:
                landed = read_tokens(out, cancel, check)
                if handback is not None:
                    landed = _tapped(landed, lambda _, t: kernel.cancel() if handback(t) else None)
                finished = yield from kernel_tokens(
                    landed,
                    n_steps,
                    matcher,
                    (kernel.grammar,),
                    kernel.rules,
                    sampling,
                    logprobs,
                )
        except GeneratorExit:  # the consumer closed the stream: a normal early end
            raise
        except BaseException:
            failed = True
            raise
        finally:
            if launched:
                if not finished:
                    kernel.cancel()
                try:
                    kernel.wait(STOP_GRACE_SECONDS if failed else None)
                except RuntimeError as e:  # still running when cancelled, or faulted
                    self.failure = (
                        f"the monokernel cannot run more requests ({e}); restart the process"
                    )
                    raise EngineFailedError(self.failure) from e
            if launched and drafting is not None:
                if failed:
                    drafting.passes.held_history(())
                else:  # the history: what was loaded and the tokens the kernel appended
                    kept = [w - 1 for w in out[2 : 2 + int(out[0])]]
                    drafting.passes.held_history((*prompt_ids[:held], step_in, *kept))
                    counts = draft_counts(kernel)
                    drafting.stats.passes += counts.passes
                    drafting.stats.drafted += counts.drafted
                    drafting.stats.accepted += counts.accepted
            if failed:
                prefix.invalidate()
            else:
                # The kernel has stopped: out[0] counts its completed steps, each of which
                # wrote the K/V of the token it was fed (more than were yielded, if the
                # consumer stopped early); a pass build's, the tokens it kept, whose inputs'
                # K/V it wrote (the rows of drafts it did not keep are not counted).
                steps = int(out[0]) if launched else 0
                generated = [w - 1 for w in out[2 : 2 + max(0, steps - 1)]]  # id + 1
                ran = (*prompt_ids[:held], step_in)
                prefix.finish(ran, fed_tokens(ran, generated, steps, forced_ids))


def begin_masks(grammars: Sequence[GrammarMask], matcher: TokenMatcher, steps: int) -> int:
    """A constrained launch's first mask tag (Launch.mask_tag) on every kernel's buffers
    (one a TP rank: their tags advance together, so they agree), with step 0's mask
    published to each."""
    tags = {grammar.begin(steps) for grammar in grammars}
    if len(tags) != 1:
        raise RuntimeError(f"the kernels' grammar tags disagree: {sorted(tags)}")
    words = matcher.words()
    for grammar in grammars:
        grammar.publish(0, words)
    return tags.pop()


def prefill_first_token(
    logits: torch.Tensor,
    sampling: SamplingParams,
    prompt_ids: Sequence[int],
    matcher: TokenMatcher | None,
    want_logprobs: bool,
) -> tuple[int, TokenLogprobs | None]:
    """The token at position len(prompt_ids) from the prefill's last logits [V], by the rule
    the kernel's steps draw with (penalties, a constrained request's mask, the seeded draw;
    one host sync), the matcher advanced past it; and its logprobs record when wanted."""
    raw = logits
    if sampling.penalized:
        logits = penalize(logits, sampling, prompt_ids, ())
    if matcher is not None:
        logits = matcher.apply(logits)
    first = sample(logits, sampling, len(prompt_ids))
    if matcher is not None:
        matcher.advance(first)
    record = None
    if want_logprobs:
        assert sampling.logprobs is not None
        record = token_logprobs(raw, first, sampling.logprobs)
    return first, record


def kernel_tokens(
    tokens: Generator[int, None, bool],
    steps: int,
    matcher: TokenMatcher | None,
    grammars: Sequence[GrammarMask],
    rules: LogitRules,
    sampling: SamplingParams,
    sink: list[TokenLogprobs] | None,
) -> Generator[int, None, bool]:
    """A launch's ``steps`` tokens as they land (token_reader.read_tokens), with a
    constrained request's next mask sent (masks_ahead) and, where ``sink`` and
    ``sampling.logprobs`` ask for them, each step's logprobs record from ``rules``
    (with_logprobs); returns whether the kernel finished."""
    if matcher is not None:
        tokens = masks_ahead(tokens, matcher, grammars, steps)
    if sink is not None and sampling.logprobs is not None:
        tokens = with_logprobs(tokens, rules, sampling.logprobs, sink)
    return tokens


def _tapped(
    tokens: Generator[int, None, bool], before: Callable[[int, int], None]
) -> Generator[int, None, bool]:
    """``tokens`` (kernel step s's token the s-th) with ``before(s, token)`` called before
    each is yielded; returns what ``tokens`` returns (whether the kernel finished)."""
    step = 0
    while True:
        try:
            token = next(tokens)
        except StopIteration as done:
            return bool(done.value)
        before(step, token)
        step += 1
        yield token


def masks_ahead(
    tokens: Generator[int, None, bool],
    matcher: TokenMatcher,
    grammars: Sequence[GrammarMask],
    steps: int,
) -> Generator[int, None, bool]:
    """Step s + 1's mask sent (to every kernel's buffers: one a TP rank) as step s's token
    lands, so the kernels, already running step s + 1, find it in time."""

    def advance(step: int, token: int) -> None:
        matcher.advance(token)
        if step + 1 < steps:
            words = matcher.words()
            for grammar in grammars:
                grammar.publish(step + 1, words)

    return _tapped(tokens, advance)


def with_logprobs(
    tokens: Generator[int, None, bool], rules: LogitRules, n: int, sink: list[TokenLogprobs]
) -> Generator[int, None, bool]:
    """Each step's logprobs record (written by the kernel before its token word) appended
    to ``sink`` as its token lands."""
    return _tapped(tokens, lambda step, _token: sink.append(rules.logprobs(step, n)))
